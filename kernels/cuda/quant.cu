// Quantized GGML blocks (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, MXFP4, Q5_0, Q5_1, IQ4_NL): a dequantizing GEMV for decode and a
// dequantization to bf16 for prefill (tiles for the cuBLAS bf16 GEMM).
// Part of the moe-lanes kernels: compiled together with common.cuh prepended (kernels/src/cuda/kernel.rs).
//
// Layouts as GGUF stores them (the CPU side, kernels/src/quant.rs, reads the same; d/dmin f16):
//   Q8_0  d, 32 i8                                                   34 bytes / 32 values
//   Q4_0  d, 16 bytes: value j low nibble, j + 16 high, minus 8      18 bytes / 32 values
//   Q4_K  d, dmin, 12 bytes of 6-bit scales/mins, 128 nibble bytes   144 bytes / 256 values
//   Q5_K  as Q4_K with 32 bytes of fifth bits before the nibbles     176 bytes / 256 values
//   Q6_K  128 low-nibble bytes, 64 bytes of 2-bit pairs, 16 i8 scales, d   210 bytes / 256 values
//   MXFP4 E8M0 byte e, 16 bytes: value j low nibble, j + 16 high, each nibble a doubled E2M1
//         value (kvalues_mxfp4) times 2^(e - 128)                    17 bytes / 32 values
//   Q5_0  d, qh (u32: bit j the fifth bit of value j), 16 nibble bytes as Q4_0, minus 16
//                                                                    22 bytes / 32 values
//   Q5_1  d, m, qh, 16 nibble bytes: d * q + m                       24 bytes / 32 values
//   IQ4_NL d, 16 nibble bytes as Q4_0, each nibble indexing kvalues_iq4nl   18 bytes / 32 values
// A matrix row of K values is K / ELEMS consecutive blocks; rows follow each other. Blocks are
// 2-byte aligned (4-byte for Q4_K/Q5_K, whose sizes are multiples of 16) when the matrix is:
// the launchers check it. MXFP4's 17-byte blocks lie at any address: they are read byte by byte. Each block is cut into LANES units of 8 values, two runs of 4
// consecutive columns; Q::unit decodes one unit exactly as the CPU decodes those values (the
// products and differences through __fmul_rn/__fsub_rn, which --fmad never fuses, so the values
// are bit-equal to the CPU's).
#include <cuda_fp16.h>

// Resident blocks per SM the decode GEMVs are compiled for (__launch_bounds__): 4 blocks of 256
// threads cap registers at 64. Without it moe_gate_up_gemv_q took 96 registers, 2 blocks per SM
// (25% occupancy), and ran latency-bound at 16% of DRAM throughput (ncu on the H100).
#define QUANT_MIN_BLOCKS 4

// ---- block decoding begin (also compiled on the host by kernels/tests/quant_cu_host.rs) ----
typedef unsigned char u8;

__device__ __forceinline__ float q_half(const u8* p) {
    return __half2float(__ushort_as_half(*(const unsigned short*)p));
}

// Four bytes at a 2-byte aligned address, little-endian.
__device__ __forceinline__ unsigned q_word2(const u8* p) {
    const unsigned short* h = (const unsigned short*)p;
    return (unsigned)h[0] | ((unsigned)h[1] << 16);
}

__device__ __forceinline__ unsigned q_byte(unsigned w, int i) { return (w >> (8 * i)) & 255u; }

struct Q8_0 {
    static constexpr int ELEMS = 32, BYTES = 34, LANES = 4;
    // unit u: values 8u .. 8u + 7
    static __device__ __forceinline__ void unit(const u8* b, int u, float* v, int& c0, int& c1) {
        float d = q_half(b);
        unsigned w0 = q_word2(b + 2 + 8 * u), w1 = q_word2(b + 6 + 8 * u);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[i] = __fmul_rn(d, (float)(signed char)q_byte(w0, i));
            v[4 + i] = __fmul_rn(d, (float)(signed char)q_byte(w1, i));
        }
        c0 = 8 * u, c1 = 8 * u + 4;
    }
    // run8 (every type): values c .. c + 7 of the block (c a multiple of 8), the unit's operations.
    static __device__ __forceinline__ void run8(const u8* b, int c, float* v) {
        float d = q_half(b);
        unsigned w0 = q_word2(b + 2 + c), w1 = q_word2(b + 6 + c);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[i] = __fmul_rn(d, (float)(signed char)q_byte(w0, i));
            v[4 + i] = __fmul_rn(d, (float)(signed char)q_byte(w1, i));
        }
    }
};

struct Q4_0 {
    static constexpr int ELEMS = 32, BYTES = 18, LANES = 4;
    // unit u: bytes 4u .. 4u + 3, values 4u .. (low nibbles) and 16 + 4u .. (high nibbles)
    static __device__ __forceinline__ void unit(const u8* b, int u, float* v, int& c0, int& c1) {
        float d = q_half(b);
        unsigned w = q_word2(b + 2 + 4 * u);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[i] = __fmul_rn(d, (float)((int)(q_byte(w, i) & 15) - 8));
            v[4 + i] = __fmul_rn(d, (float)((int)(q_byte(w, i) >> 4) - 8));
        }
        c0 = 4 * u, c1 = 16 + 4 * u;
    }
    static __device__ __forceinline__ void run8(const u8* b, int c, float* v) {
        float d = q_half(b);
        int sh = c < 16 ? 0 : 4;
        unsigned w0 = q_word2(b + 2 + (c & 15)), w1 = q_word2(b + 6 + (c & 15));
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[i] = __fmul_rn(d, (float)((int)((q_byte(w0, i) >> sh) & 15) - 8));
            v[4 + i] = __fmul_rn(d, (float)((int)((q_byte(w1, i) >> sh) & 15) - 8));
        }
    }
};

// MXFP4's scale: 2^(e - 128), half the E8M0 value, as the CPU (and llama.cpp's CPU code,
// ggml_e8m0_to_fp32_half) computes it: subnormal bit patterns for e < 2, and e = 0xFF (NaN in the
// MX spec) read as 2^127, so device and CPU values agree for every byte.
__device__ __forceinline__ float mx_scale(unsigned e) {
    return __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
}

// Four bytes at any address, little-endian (MXFP4 blocks are 17 bytes: no aligned words).
__device__ __forceinline__ unsigned mx_word(const u8* p) {
    return (unsigned)p[0] | ((unsigned)p[1] << 8) | ((unsigned)p[2] << 16) | ((unsigned)p[3] << 24);
}

// The 16 bytes at any address p (an MXFP4 block's nibbles) as four little-endian words: the four
// aligned words from p & ~3 (up to 3 bytes before p: the block's scale or the bytes before it, in
// the same 4-aligned buffer) and the last (p & 3) bytes one by one, joined by funnel shifts.
// Nothing past p + 15 is read; 4 to 7 loads instead of 16.
__device__ __forceinline__ void mx_bytes16(const u8* p, unsigned* w) {
    size_t a = (size_t)p & ~(size_t)3;
    unsigned o = (unsigned)((size_t)p & 3), sh = 8 * o;
    const unsigned* q = (const unsigned*)a;
    const u8* t = (const u8*)(a + 16);
    unsigned v[5] = {q[0], q[1], q[2], q[3], 0u};
    if (o > 0) v[4] = t[0];
    if (o > 1) v[4] |= (unsigned)t[1] << 8;
    if (o > 2) v[4] |= (unsigned)t[2] << 16;
#pragma unroll
    for (int k = 0; k < 4; k++) w[k] = __funnelshift_r(v[k], v[k + 1], sh);
}

// The doubled E2M1 values (signed bytes: 0 1 2 3 4 6 8 12, and their negatives for nibbles 8..15,
// with +0 for nibble 8) of the four nibbles in the low halves of q's bytes: the magnitudes by two
// byte permutes (selector nibbles from the low three bits), the sign from bit 3.
__device__ __forceinline__ unsigned mx_levels4(unsigned q) {
    unsigned t = q & 0x07070707u, u = t | (t >> 4);
    unsigned sel = (u & 0xFFu) | ((u >> 8) & 0xFF00u);
    unsigned pos = __byte_perm(0x03020100u, 0x0C080604u, sel);
    unsigned neg = __byte_perm(0xFDFEFF00u, 0xF4F8FAFCu, sel);
    unsigned m = ((q >> 3) & 0x01010101u) * 0xFFu;
    return (pos & ~m) | (neg & m);
}

struct QMX {
    static constexpr int ELEMS = 32, BYTES = 17, LANES = 4;
    // unit u: nibble bytes 4u .. 4u + 3, values 4u .. (low nibbles) and 16 + 4u .. (high nibbles)
    static __device__ __forceinline__ void unit(const u8* b, int u, float* v, int& c0, int& c1) {
        float d = mx_scale(b[0]);
        unsigned w = mx_word(b + 1 + 4 * u);
        unsigned lo = mx_levels4(w & 0x0F0F0F0Fu), hi = mx_levels4((w >> 4) & 0x0F0F0F0Fu);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[i] = __fmul_rn((float)(signed char)q_byte(lo, i), d);
            v[4 + i] = __fmul_rn((float)(signed char)q_byte(hi, i), d);
        }
        c0 = 4 * u, c1 = 16 + 4 * u;
    }
    static __device__ __forceinline__ void run8(const u8* b, int c, float* v) {
        float d = mx_scale(b[0]);
        int sh = c < 16 ? 0 : 4;
        unsigned w0 = mx_word(b + 1 + (c & 15)), w1 = mx_word(b + 5 + (c & 15));
        unsigned l0 = mx_levels4((w0 >> sh) & 0x0F0F0F0Fu), l1 = mx_levels4((w1 >> sh) & 0x0F0F0F0Fu);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[i] = __fmul_rn((float)(signed char)q_byte(l0, i), d);
            v[4 + i] = __fmul_rn((float)(signed char)q_byte(l1, i), d);
        }
    }
};

// Bits 0..3 of n spread to bit 4 of bytes 0..3 (a Q5 block's fifth bits of four values).
__device__ __forceinline__ unsigned q5_spread4(unsigned n) {
    return ((n & 1u) | ((n & 2u) << 7) | ((n & 4u) << 14) | ((n & 8u) << 21)) << 4;
}

// Q5_0 (MIN false) and Q5_1 (MIN true): the nibble word w of bytes 4u .. 4u + 3 and the qh word
// give the five-bit levels of values 4u .. (lo) and 16 + 4u .. (hi), one per byte.
template <bool MIN>
struct Q5 {
    static constexpr int ELEMS = 32, BYTES = MIN ? 24 : 22, LANES = 4, QH = MIN ? 4 : 2;
    static __device__ __forceinline__ void levels4(const u8* b, int u, unsigned& lo, unsigned& hi) {
        unsigned qh = q_word2(b + QH), w = q_word2(b + QH + 4 + 4 * u);
        lo = (w & 0x0F0F0F0Fu) | q5_spread4((qh >> (4 * u)) & 15u);
        hi = ((w >> 4) & 0x0F0F0F0Fu) | q5_spread4((qh >> (16 + 4 * u)) & 15u);
    }
    static __device__ __forceinline__ float value(const u8* b, float d, unsigned q) {
        return MIN ? __fadd_rn(__fmul_rn((float)q, d), q_half(b + 2)) : __fmul_rn((float)((int)q - 16), d);
    }
    static __device__ __forceinline__ void unit(const u8* b, int u, float* v, int& c0, int& c1) {
        float d = q_half(b);
        unsigned lo, hi;
        levels4(b, u, lo, hi);
#pragma unroll
        for (int i = 0; i < 4; i++) v[i] = value(b, d, q_byte(lo, i)), v[4 + i] = value(b, d, q_byte(hi, i));
        c0 = 4 * u, c1 = 16 + 4 * u;
    }
    static __device__ __forceinline__ void run8(const u8* b, int c, float* v) {
        float d = q_half(b);
        unsigned lo0, hi0, lo1, hi1;
        levels4(b, (c & 15) >> 2, lo0, hi0);
        levels4(b, ((c & 15) >> 2) + 1, lo1, hi1);
        unsigned l0 = c < 16 ? lo0 : hi0, l1 = c < 16 ? lo1 : hi1;
#pragma unroll
        for (int i = 0; i < 4; i++) v[i] = value(b, d, q_byte(l0, i)), v[4 + i] = value(b, d, q_byte(l1, i));
    }
};
typedef Q5<false> Q5_0;
typedef Q5<true> Q5_1;

// The IQ4_NL levels (kvalues_iq4nl as signed bytes) of the four nibbles in the low halves of q's
// bytes: two byte permutes over the table's halves (selectors from the low three bits), the half
// chosen by bit 3.
__device__ __forceinline__ unsigned nl_levels4(unsigned q) {
    unsigned t = q & 0x07070707u, u = t | (t >> 4);
    unsigned sel = (u & 0xFFu) | ((u >> 8) & 0xFF00u);
    unsigned neg = __byte_perm(0xBFAD9881u, 0xF6EADDCFu, sel);  // -127 -104 -83 -65 -49 -35 -22 -10
    unsigned pos = __byte_perm(0x26190D01u, 0x71594535u, sel);  // 1 13 25 38 53 69 89 113
    unsigned m = ((q >> 3) & 0x01010101u) * 0xFFu;
    return (neg & ~m) | (pos & m);
}

struct QNL {
    static constexpr int ELEMS = 32, BYTES = 18, LANES = 4;
    // unit u: bytes 4u .. 4u + 3, values 4u .. (low nibbles) and 16 + 4u .. (high nibbles)
    static __device__ __forceinline__ void unit(const u8* b, int u, float* v, int& c0, int& c1) {
        float d = q_half(b);
        unsigned w = q_word2(b + 2 + 4 * u);
        unsigned lo = nl_levels4(w & 0x0F0F0F0Fu), hi = nl_levels4((w >> 4) & 0x0F0F0F0Fu);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[i] = __fmul_rn(d, (float)(signed char)q_byte(lo, i));
            v[4 + i] = __fmul_rn(d, (float)(signed char)q_byte(hi, i));
        }
        c0 = 4 * u, c1 = 16 + 4 * u;
    }
    static __device__ __forceinline__ void run8(const u8* b, int c, float* v) {
        float d = q_half(b);
        int sh = c < 16 ? 0 : 4;
        unsigned w0 = q_word2(b + 2 + (c & 15)), w1 = q_word2(b + 6 + (c & 15));
        unsigned l0 = nl_levels4((w0 >> sh) & 0x0F0F0F0Fu), l1 = nl_levels4((w1 >> sh) & 0x0F0F0F0Fu);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[i] = __fmul_rn(d, (float)(signed char)q_byte(l0, i));
            v[4 + i] = __fmul_rn(d, (float)(signed char)q_byte(l1, i));
        }
    }
};

// The 6-bit scale and min of sub-block j of a Q4_K/Q5_K block's 12 packed bytes.
__device__ __forceinline__ void k_scale_min(int j, const u8* p, float& sc, float& m) {
    if (j < 4) {
        sc = (float)(p[j] & 63), m = (float)(p[j + 4] & 63);
    } else {
        sc = (float)((p[j + 4] & 15) | ((p[j - 4] >> 6) << 4));
        m = (float)((p[j + 4] >> 4) | ((p[j] >> 6) << 4));
    }
}

// Q4_K (fifth bits none) and Q5_K: x = (d * sc) * q - (dmin * m) per sub-block of 32. Unit u:
// pair p = u / 8 of sub-blocks (2p from the low nibbles, 2p + 1 from the high ones of the same 32
// bytes), bytes 4 (u % 8) .. + 3 of that pair's 32.
template <bool FIFTH>
__device__ __forceinline__ void k_asym_unit(const u8* b, int u, float* v, int& c0, int& c1) {
    int p = u >> 3, o = u & 7;
    float d = q_half(b), dmin = q_half(b + 2);
    float sc0, m0, sc1, m1;
    k_scale_min(2 * p, b + 4, sc0, m0);
    k_scale_min(2 * p + 1, b + 4, sc1, m1);
    float s0 = __fmul_rn(d, sc0), n0 = __fmul_rn(dmin, m0);
    float s1 = __fmul_rn(d, sc1), n1 = __fmul_rn(dmin, m1);
    unsigned qs = *(const unsigned*)(b + (FIFTH ? 48 : 16) + 32 * p + 4 * o);
    unsigned qh = FIFTH ? *(const unsigned*)(b + 16 + 4 * o) : 0u;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        unsigned q = q_byte(qs, i), h = q_byte(qh, i);
        unsigned lo = (q & 15) | (((h >> (2 * p)) & 1) << 4);
        unsigned hi = (q >> 4) | (((h >> (2 * p + 1)) & 1) << 4);
        v[i] = __fsub_rn(__fmul_rn(s0, (float)lo), n0);
        v[4 + i] = __fsub_rn(__fmul_rn(s1, (float)hi), n1);
    }
    c0 = 64 * p + 4 * o, c1 = 64 * p + 32 + 4 * o;
}

// Values c .. c + 7 of a Q4_K/Q5_K block: sub-block j = c / 32 (pair p = j / 2, low nibbles for
// even j), bytes l = c % 32 .. + 7 of the pair's 32; the same operations as k_asym_unit.
template <bool FIFTH>
__device__ __forceinline__ void k_asym_run8(const u8* b, int c, float* v) {
    int j = c >> 5, p = j >> 1, l = c & 31, sh = 4 * (j & 1);
    float d = q_half(b), dmin = q_half(b + 2), sc, m;
    k_scale_min(j, b + 4, sc, m);
    float s = __fmul_rn(d, sc), n = __fmul_rn(dmin, m);
    const u8* qs = b + (FIFTH ? 48 : 16) + 32 * p + l;
    unsigned q[2] = {q_word2(qs), q_word2(qs + 4)}, h[2] = {0u, 0u};
    if (FIFTH) h[0] = q_word2(b + 16 + l), h[1] = q_word2(b + 20 + l);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        unsigned x = (q_byte(q[i >> 2], i & 3) >> sh) & 15;
        x |= ((q_byte(h[i >> 2], i & 3) >> j) & 1) << 4;
        v[i] = __fsub_rn(__fmul_rn(s, (float)x), n);
    }
}

struct Q4_K {
    static constexpr int ELEMS = 256, BYTES = 144, LANES = 32;
    static __device__ __forceinline__ void unit(const u8* b, int u, float* v, int& c0, int& c1) {
        k_asym_unit<false>(b, u, v, c0, c1);
    }
    static __device__ __forceinline__ void run8(const u8* b, int c, float* v) { k_asym_run8<false>(b, c, v); }
};

struct Q5_K {
    static constexpr int ELEMS = 256, BYTES = 176, LANES = 32;
    static __device__ __forceinline__ void unit(const u8* b, int u, float* v, int& c0, int& c1) {
        k_asym_unit<true>(b, u, v, c0, c1);
    }
    static __device__ __forceinline__ void run8(const u8* b, int c, float* v) { k_asym_run8<true>(b, c, v); }
};

// Q6_K: x = (d * sc) * (q - 32), one signed scale per 16 values. Value l (0..32) of quarter
// qr (0..4) of half h: 4 low bits from ql[64h + l + 32 (qr & 1)] (low nibble for qr < 2, high
// for qr >= 2), 2 high bits from qh[32h + l] >> 2 qr, scale scales[8h + 2 qr + l / 16]. Unit u:
// half h = u / 16, quarters qp and qp + 2 (qp = u / 8 % 2, which share their ql bytes),
// l = 4 (u % 8) .. + 3.
struct Q6_K {
    static constexpr int ELEMS = 256, BYTES = 210, LANES = 32;
    static __device__ __forceinline__ void unit(const u8* b, int u, float* v, int& c0, int& c1) {
        int h = u >> 4, qp = (u >> 3) & 1, j = u & 7;
        float d = q_half(b + 208);
        const signed char* scales = (const signed char*)(b + 192 + 8 * h);
        float s0 = __fmul_rn(d, (float)scales[2 * qp + (j >> 2)]);
        float s1 = __fmul_rn(d, (float)scales[2 * (qp + 2) + (j >> 2)]);
        unsigned ql = q_word2(b + 64 * h + 32 * qp + 4 * j), qh = q_word2(b + 128 + 32 * h + 4 * j);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            unsigned q = q_byte(ql, i), hb = q_byte(qh, i);
            int lo = (int)((q & 15) | (((hb >> (2 * qp)) & 3) << 4));
            int hi = (int)((q >> 4) | (((hb >> (2 * qp + 4)) & 3) << 4));
            v[i] = __fmul_rn(s0, (float)(lo - 32));
            v[4 + i] = __fmul_rn(s1, (float)(hi - 32));
        }
        c0 = 128 * h + 32 * qp + 4 * j, c1 = 128 * h + 32 * (qp + 2) + 4 * j;
    }
    // Values c .. c + 7: half h = c / 128, quarter qr = c / 32 % 4, l = c % 32 .. + 7.
    static __device__ __forceinline__ void run8(const u8* b, int c, float* v) {
        int h = c >> 7, qr = (c >> 5) & 3, l = c & 31;
        float s = __fmul_rn(q_half(b + 208), (float)((const signed char*)(b + 192))[8 * h + 2 * qr + (l >> 4)]);
        const u8* ql = b + 64 * h + 32 * (qr & 1) + l;
        const u8* qh = b + 128 + 32 * h + l;
        unsigned a[2] = {q_word2(ql), q_word2(ql + 4)}, z[2] = {q_word2(qh), q_word2(qh + 4)};
        int sh = qr < 2 ? 0 : 4;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            unsigned lo = (q_byte(a[i >> 2], i & 3) >> sh) & 15, hb = (q_byte(z[i >> 2], i & 3) >> (2 * qr)) & 3;
            v[i] = __fmul_rn(s, (float)((int)(lo | (hb << 4)) - 32));
        }
    }
};

// ---- wide decoding: 32 values per lane ----
// Q::cols(j, c) gives the 4 runs of 8 consecutive columns that chunk j (of Q::CHUNKS per block)
// covers; Q::chunk(b, j, v) decodes that chunk into v[32] with the same operations as Q::unit (so
// the same bits). The decode GEMVs read chunks through chunk_dot (below: the same loads and the
// same layout, the scale factored out); Q::chunk is the exact decoding of that layout, which the
// host test checks against gguf-py's values and for covering every column once. A lane reads its
// chunk with few wide loads (uint4 for Q4_K/Q5_K, whose blocks are 16-byte aligned when the
// matrix is; aligned words and funnel shifts for the 2-byte aligned types).

// Eight bytes at a 2-byte aligned address as two little-endian words.
__device__ __forceinline__ void q_load8(const u8* p, unsigned& lo, unsigned& hi) {
    if ((((size_t)p) & 3) == 0) {
        lo = ((const unsigned*)p)[0], hi = ((const unsigned*)p)[1];
    } else {
        unsigned a = *(const unsigned short*)p, m = *(const unsigned*)(p + 2), z = *(const unsigned short*)(p + 6);
        lo = a | (m << 16), hi = (m >> 16) | (z << 16);
    }
}

// `n` little-endian words of the bytes at a 2-byte aligned `p` (p + 4n inside the block).
template <int N>
__device__ __forceinline__ void q_words(const u8* p, unsigned* w) {
    if ((((size_t)p) & 3) == 0) {
#pragma unroll
        for (int i = 0; i < N; i++) w[i] = ((const unsigned*)p)[i];
    } else {
        const unsigned* a = (const unsigned*)(p - 2);
        unsigned prev = a[0];
#pragma unroll
        for (int i = 0; i < N; i++) {
            unsigned next = i + 1 < N ? a[i + 1] : (unsigned)*(const unsigned short*)(p + 4 * N - 2);
            w[i] = __funnelshift_r(prev, next, 16);
            prev = next;
        }
    }
}

struct W8_0 : Q8_0 {
    static constexpr int CHUNKS = 1;
    static __device__ __forceinline__ void cols(int, int* c) { c[0] = 0, c[1] = 8, c[2] = 16, c[3] = 24; }
    static __device__ __forceinline__ void chunk(const u8* b, int, float* v) {
        float d = q_half(b);
        unsigned w[8];
        q_words<8>(b + 2, w);
#pragma unroll
        for (int i = 0; i < 32; i++) v[i] = __fmul_rn(d, (float)(signed char)q_byte(w[i >> 2], i & 3));
    }
};

struct W4_0 : Q4_0 {
    static constexpr int CHUNKS = 1;
    static __device__ __forceinline__ void cols(int, int* c) { c[0] = 0, c[1] = 8, c[2] = 16, c[3] = 24; }
    static __device__ __forceinline__ void chunk(const u8* b, int, float* v) {
        float d = q_half(b);
        unsigned w[4];
        q_words<4>(b + 2, w);
#pragma unroll
        for (int i = 0; i < 16; i++) {
            unsigned q = q_byte(w[i >> 2], i & 3);
            v[i] = __fmul_rn(d, (float)((int)(q & 15) - 8));
            v[16 + i] = __fmul_rn(d, (float)((int)(q >> 4) - 8));
        }
    }
};

// MXFP4's one chunk: the 16 nibble bytes as four words (byte loads), low nibbles columns 0..15,
// high ones 16..31.
struct WMX : QMX {
    static constexpr int CHUNKS = 1;
    static __device__ __forceinline__ void cols(int, int* c) { c[0] = 0, c[1] = 8, c[2] = 16, c[3] = 24; }
    static __device__ __forceinline__ void levels(const u8* b, unsigned* lo, unsigned* hi) {
        unsigned w[4];
        mx_bytes16(b + 1, w);
#pragma unroll
        for (int k = 0; k < 4; k++) lo[k] = mx_levels4(w[k] & 0x0F0F0F0Fu), hi[k] = mx_levels4((w[k] >> 4) & 0x0F0F0F0Fu);
    }
    static __device__ __forceinline__ void chunk(const u8* b, int, float* v) {
        float d = mx_scale(b[0]);
        unsigned lo[4], hi[4];
        levels(b, lo, hi);
#pragma unroll
        for (int i = 0; i < 16; i++) {
            v[i] = __fmul_rn((float)(signed char)q_byte(lo[i >> 2], i & 3), d);
            v[16 + i] = __fmul_rn((float)(signed char)q_byte(hi[i >> 2], i & 3), d);
        }
    }
};

// Q5_0 / Q5_1's one chunk: the levels as four words per half (low nibbles columns 0..15, high
// ones 16..31), the fifth bits spread into bit 4 of each byte.
template <bool MIN>
struct W5 : Q5<MIN> {
    static constexpr int CHUNKS = 1;
    static __device__ __forceinline__ void cols(int, int* c) { c[0] = 0, c[1] = 8, c[2] = 16, c[3] = 24; }
    static __device__ __forceinline__ void levels(const u8* b, unsigned* lo, unsigned* hi) {
#pragma unroll
        for (int k = 0; k < 4; k++) Q5<MIN>::levels4(b, k, lo[k], hi[k]);
    }
    static __device__ __forceinline__ void chunk(const u8* b, int, float* v) {
        float d = q_half(b);
        unsigned lo[4], hi[4];
        levels(b, lo, hi);
#pragma unroll
        for (int i = 0; i < 16; i++) {
            v[i] = Q5<MIN>::value(b, d, q_byte(lo[i >> 2], i & 3));
            v[16 + i] = Q5<MIN>::value(b, d, q_byte(hi[i >> 2], i & 3));
        }
    }
};
typedef W5<false> W5_0;
typedef W5<true> W5_1;

// IQ4_NL's one chunk: the 16 nibble bytes as four words, each nibble's table level.
struct WNL : QNL {
    static constexpr int CHUNKS = 1;
    static __device__ __forceinline__ void cols(int, int* c) { c[0] = 0, c[1] = 8, c[2] = 16, c[3] = 24; }
    static __device__ __forceinline__ void levels(const u8* b, unsigned* lo, unsigned* hi) {
        unsigned w[4];
        q_words<4>(b + 2, w);
#pragma unroll
        for (int k = 0; k < 4; k++) lo[k] = nl_levels4(w[k] & 0x0F0F0F0Fu), hi[k] = nl_levels4((w[k] >> 4) & 0x0F0F0F0Fu);
    }
    static __device__ __forceinline__ void chunk(const u8* b, int, float* v) {
        float d = q_half(b);
        unsigned lo[4], hi[4];
        levels(b, lo, hi);
#pragma unroll
        for (int i = 0; i < 16; i++) {
            v[i] = __fmul_rn(d, (float)(signed char)q_byte(lo[i >> 2], i & 3));
            v[16 + i] = __fmul_rn(d, (float)(signed char)q_byte(hi[i >> 2], i & 3));
        }
    }
};

// Q4_K/Q5_K chunk j: pair p = j / 2 of sub-blocks, bytes 16 (j % 2) .. + 15 of the pair's 32:
// low nibbles are sub-block 2p (columns 64p + 16h ..), high ones 2p + 1 (columns 64p + 32 + 16h ..).
template <bool FIFTH>
__device__ __forceinline__ void k_asym_chunk(const u8* b, int j, float* v) {
    int p = j >> 1, h = j & 1;
    const unsigned* hw = (const unsigned*)b;
    unsigned dd = hw[0], sw[3] = {hw[1], hw[2], hw[3]};
    u8 sc[12];
#pragma unroll
    for (int i = 0; i < 12; i++) sc[i] = (u8)q_byte(sw[i >> 2], i & 3);
    float d = __half2float(__ushort_as_half((unsigned short)(dd & 0xffff)));
    float dmin = __half2float(__ushort_as_half((unsigned short)(dd >> 16)));
    float sc0, m0, sc1, m1;
    k_scale_min(2 * p, sc, sc0, m0);
    k_scale_min(2 * p + 1, sc, sc1, m1);
    float s0 = __fmul_rn(d, sc0), n0 = __fmul_rn(dmin, m0);
    float s1 = __fmul_rn(d, sc1), n1 = __fmul_rn(dmin, m1);
    uint4 q4 = *(const uint4*)(b + (FIFTH ? 48 : 16) + 32 * p + 16 * h);
    uint4 h4 = FIFTH ? *(const uint4*)(b + 16 + 16 * h) : make_uint4(0, 0, 0, 0);
    unsigned qw[4] = {q4.x, q4.y, q4.z, q4.w}, hwd[4] = {h4.x, h4.y, h4.z, h4.w};
#pragma unroll
    for (int i = 0; i < 16; i++) {
        unsigned q = q_byte(qw[i >> 2], i & 3), hb = q_byte(hwd[i >> 2], i & 3);
        unsigned lo = (q & 15) | (((hb >> (2 * p)) & 1) << 4);
        unsigned hi = (q >> 4) | (((hb >> (2 * p + 1)) & 1) << 4);
        v[i] = __fsub_rn(__fmul_rn(s0, (float)lo), n0);
        v[16 + i] = __fsub_rn(__fmul_rn(s1, (float)hi), n1);
    }
}

__device__ __forceinline__ void k_asym_cols(int j, int* c) {
    int c0 = 64 * (j >> 1) + 16 * (j & 1);
    c[0] = c0, c[1] = c0 + 8, c[2] = c0 + 32, c[3] = c0 + 40;
}

struct W4_K : Q4_K {
    static constexpr int CHUNKS = 8;
    static __device__ __forceinline__ void cols(int j, int* c) { k_asym_cols(j, c); }
    static __device__ __forceinline__ void chunk(const u8* b, int j, float* v) { k_asym_chunk<false>(b, j, v); }
};

struct W5_K : Q5_K {
    static constexpr int CHUNKS = 8;
    static __device__ __forceinline__ void cols(int j, int* c) { k_asym_cols(j, c); }
    static __device__ __forceinline__ void chunk(const u8* b, int j, float* v) { k_asym_chunk<true>(b, j, v); }
};

// Q6_K chunk j: half hf = j / 4, l = l0 .. l0 + 7 (l0 = 8 (j % 4)) of all four quarters.
struct W6_K : Q6_K {
    static constexpr int CHUNKS = 8;
    static __device__ __forceinline__ void cols(int j, int* c) {
        int c0 = 128 * (j >> 2) + 8 * (j & 3);
        c[0] = c0, c[1] = c0 + 32, c[2] = c0 + 64, c[3] = c0 + 96;
    }
    static __device__ __forceinline__ void chunk(const u8* b, int j, float* v) {
        int hf = j >> 2, l0 = 8 * (j & 3);
        unsigned a[2], bb[2], hh[2], sw[2];
        q_load8(b + 64 * hf + l0, a[0], a[1]);
        q_load8(b + 64 * hf + 32 + l0, bb[0], bb[1]);
        q_load8(b + 128 + 32 * hf + l0, hh[0], hh[1]);
        q_load8(b + 192 + 8 * hf, sw[0], sw[1]);
        float d = q_half(b + 208), s[4];
#pragma unroll
        for (int q = 0; q < 4; q++) {
            int at = 2 * q + (l0 >> 4);
            s[q] = __fmul_rn(d, (float)(signed char)q_byte(sw[at >> 2], at & 3));
        }
#pragma unroll
        for (int i = 0; i < 8; i++) {
            unsigned x = q_byte(a[i >> 2], i & 3), y = q_byte(bb[i >> 2], i & 3), z = q_byte(hh[i >> 2], i & 3);
            v[i] = __fmul_rn(s[0], (float)((int)((x & 15) | ((z & 3) << 4)) - 32));
            v[8 + i] = __fmul_rn(s[1], (float)((int)((y & 15) | (((z >> 2) & 3) << 4)) - 32));
            v[16 + i] = __fmul_rn(s[2], (float)((int)((x >> 4) | (((z >> 4) & 3) << 4)) - 32));
            v[24 + i] = __fmul_rn(s[3], (float)((int)((y >> 4) | (((z >> 6) & 3) << 4)) - 32));
        }
    }
};

// ---- block decoding end ----

// ---- factored chunk dot products (the decode GEMVs) ----
// chunk_dot<W>(b, j, xv, xs) = sum_i value_i * xv[i] over chunk j of block b (xv as W::cols
// places them), with each scale (and min) applied once per run of equal scale: s * sum(q x) -
// m * sum(x), where xs[0] / xs[1] are the sums of xv[0..16) / xv[16..32) (only the K-quants with
// mins read them). A quant value q becomes a float without a conversion instruction: the byte
// under the exponent of 2^23 (q_f23) is 2^23 + q exactly, and one add takes the 2^23 and the
// type's offset off, exactly. Rounding differs from summing the dequantized values only in f32
// order and the factored scale (within the GEMV tests' tolerance); the exact values remain what
// W::chunk computes (the dequantization and the embedding use those).

// Byte i of w as the float 2^23 + byte.
__device__ __forceinline__ float q_f23(unsigned w, int i) {
    return __int_as_float(__byte_perm(w, 0x4B000000u, 0x7540u | (unsigned)i));
}

// sum_i (byte_i(w) + off) * x[i] added to acc, off given as 2^23 - off (an exact float).
__device__ __forceinline__ float q_dot4(unsigned w, float sub, const float* x, float acc) {
#pragma unroll
    for (int i = 0; i < 4; i++) acc = fmaf(q_f23(w, i) - sub, x[i], acc);
    return acc;
}

template <class W>
struct NeedsXSum {
    static constexpr bool value = false;
};
template <>
struct NeedsXSum<W4_K> {
    static constexpr bool value = true;
};
template <>
struct NeedsXSum<W5_K> {
    static constexpr bool value = true;
};

template <class W>
__device__ __forceinline__ float chunk_dot(const u8* b, int j, const float* xv, const float* xs);

template <>
__device__ __forceinline__ float chunk_dot<W8_0>(const u8* b, int, const float* xv, const float*) {
    unsigned w[8];
    q_words<8>(b + 2, w);
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < 8; k++) s = q_dot4(w[k] ^ 0x80808080u, 8388736.f, xv + 4 * k, s);  // signed: +128
    return q_half(b) * s;
}

template <>
__device__ __forceinline__ float chunk_dot<W4_0>(const u8* b, int, const float* xv, const float*) {
    unsigned w[4];
    q_words<4>(b + 2, w);
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        s = q_dot4(w[k] & 0x0F0F0F0Fu, 8388616.f, xv + 4 * k, s);  // q - 8
        s = q_dot4((w[k] >> 4) & 0x0F0F0F0Fu, 8388616.f, xv + 16 + 4 * k, s);
    }
    return q_half(b) * s;
}

// MXFP4: the levels are signed bytes (+128 under the 2^23 trick, as Q8_0's), the scale once.
template <>
__device__ __forceinline__ float chunk_dot<WMX>(const u8* b, int, const float* xv, const float*) {
    unsigned lo[4], hi[4];
    WMX::levels(b, lo, hi);
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        s = q_dot4(lo[k] ^ 0x80808080u, 8388736.f, xv + 4 * k, s);
        s = q_dot4(hi[k] ^ 0x80808080u, 8388736.f, xv + 16 + 4 * k, s);
    }
    return mx_scale(b[0]) * s;
}

// Q5_0 (levels minus 16 under the 2^23 trick) and Q5_1 (levels, then m times the sum of x).
template <>
__device__ __forceinline__ float chunk_dot<W5_0>(const u8* b, int, const float* xv, const float*) {
    unsigned lo[4], hi[4];
    W5_0::levels(b, lo, hi);
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        s = q_dot4(lo[k], 8388624.f, xv + 4 * k, s);  // q - 16
        s = q_dot4(hi[k], 8388624.f, xv + 16 + 4 * k, s);
    }
    return q_half(b) * s;
}

template <>
__device__ __forceinline__ float chunk_dot<W5_1>(const u8* b, int, const float* xv, const float*) {
    unsigned lo[4], hi[4];
    W5_1::levels(b, lo, hi);
    float s = 0.f, xs = 0.f;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        s = q_dot4(lo[k], 8388608.f, xv + 4 * k, s);
        s = q_dot4(hi[k], 8388608.f, xv + 16 + 4 * k, s);
    }
#pragma unroll
    for (int i = 0; i < 32; i++) xs += xv[i];
    return q_half(b) * s + q_half(b + 2) * xs;
}

// IQ4_NL: signed table levels (+128 under the 2^23 trick, as Q8_0's), the scale once.
template <>
__device__ __forceinline__ float chunk_dot<WNL>(const u8* b, int, const float* xv, const float*) {
    unsigned lo[4], hi[4];
    WNL::levels(b, lo, hi);
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        s = q_dot4(lo[k] ^ 0x80808080u, 8388736.f, xv + 4 * k, s);
        s = q_dot4(hi[k] ^ 0x80808080u, 8388736.f, xv + 16 + 4 * k, s);
    }
    return q_half(b) * s;
}

// k_scale_min of sub-block j from the packed bytes as three little-endian words (w0 = bytes
// 0..3, ...), by shifts: a run-time index into a byte array would live in local memory.
__device__ __forceinline__ void k_scale_min_words(int j, unsigned w0, unsigned w1, unsigned w2, float& sc,
                                                  float& m) {
    int sh = 8 * (j & 3);
    if (j < 4) {
        sc = (float)((w0 >> sh) & 63u), m = (float)((w1 >> sh) & 63u);
    } else {
        sc = (float)(((w2 >> sh) & 15u) | (((w0 >> sh) >> 6 & 3u) << 4));
        m = (float)(((w2 >> sh) >> 4 & 15u) | (((w1 >> sh) >> 6 & 3u) << 4));
    }
}

// Chunk j of a Q4_K / Q5_K block as the chunk dots read it: the scales d * sc and mins dmin * m
// of sub-blocks 2p (s[0], n[0]) and 2p + 1 (s[1], n[1]), and the levels as words of 4 bytes:
// lo[k] sub-block 2p's, hi[k] sub-block 2p + 1's.
template <bool FIFTH>
__device__ __forceinline__ void k_asym_levels(const u8* b, int j, float* s, float* n, unsigned* lo, unsigned* hi) {
    int p = j >> 1, h = j & 1;
    uint4 head = *(const uint4*)b;  // d, dmin and the 12 packed scale bytes
    float d = __half2float(__ushort_as_half((unsigned short)(head.x & 0xffff)));
    float dmin = __half2float(__ushort_as_half((unsigned short)(head.x >> 16)));
    float sc0, m0, sc1, m1;
    k_scale_min_words(2 * p, head.y, head.z, head.w, sc0, m0);
    k_scale_min_words(2 * p + 1, head.y, head.z, head.w, sc1, m1);
    s[0] = d * sc0, n[0] = dmin * m0, s[1] = d * sc1, n[1] = dmin * m1;
    uint4 q4 = *(const uint4*)(b + (FIFTH ? 48 : 16) + 32 * p + 16 * h);
    uint4 h4 = FIFTH ? *(const uint4*)(b + 16 + 16 * h) : make_uint4(0, 0, 0, 0);
    unsigned qw[4] = {q4.x, q4.y, q4.z, q4.w}, hwd[4] = {h4.x, h4.y, h4.z, h4.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        lo[k] = qw[k] & 0x0F0F0F0Fu, hi[k] = (qw[k] >> 4) & 0x0F0F0F0Fu;
        if (FIFTH) {
            lo[k] |= ((hwd[k] >> (2 * p)) & 0x01010101u) << 4;
            hi[k] |= ((hwd[k] >> (2 * p + 1)) & 0x01010101u) << 4;
        }
    }
}

template <bool FIFTH>
__device__ __forceinline__ float k_asym_dot(const u8* b, int j, const float* xv, const float* xs) {
    float s[2], n[2];
    unsigned lo[4], hi[4];
    k_asym_levels<FIFTH>(b, j, s, n, lo, hi);
    float a0 = 0.f, a1 = 0.f;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        a0 = q_dot4(lo[k], 8388608.f, xv + 4 * k, a0);
        a1 = q_dot4(hi[k], 8388608.f, xv + 16 + 4 * k, a1);
    }
    return s[0] * a0 - n[0] * xs[0] + s[1] * a1 - n[1] * xs[1];
}

template <>
__device__ __forceinline__ float chunk_dot<W4_K>(const u8* b, int j, const float* xv, const float* xs) {
    return k_asym_dot<false>(b, j, xv, xs);
}

template <>
__device__ __forceinline__ float chunk_dot<W5_K>(const u8* b, int j, const float* xv, const float* xs) {
    return k_asym_dot<true>(b, j, xv, xs);
}

// Q6_K chunk j: the four runs of 8 (one per quarter, each under one scale) as W6_K::chunk reads them.
// Chunk j of a Q6_K block as the chunk dots read it: q[k][r] the levels (0..63) of quarter r's
// values 4k .. 4k + 3 of the chunk's 8, and sw the half's 8 scale bytes as two words.
__device__ __forceinline__ void q6_levels(const u8* b, int j, unsigned (*q)[4], unsigned* sw) {
    int hf = j >> 2, l0 = 8 * (j & 3);
    unsigned a[2], bb[2], hh[2];
    q_load8(b + 64 * hf + l0, a[0], a[1]);
    q_load8(b + 64 * hf + 32 + l0, bb[0], bb[1]);
    q_load8(b + 128 + 32 * hf + l0, hh[0], hh[1]);
    q_load8(b + 192 + 8 * hf, sw[0], sw[1]);
#pragma unroll
    for (int k = 0; k < 2; k++) {
        unsigned A = a[k], B = bb[k], Z = hh[k];
        q[k][0] = (A & 0x0F0F0F0Fu) | ((Z & 0x03030303u) << 4);
        q[k][1] = (B & 0x0F0F0F0Fu) | (((Z >> 2) & 0x03030303u) << 4);
        q[k][2] = ((A >> 4) & 0x0F0F0F0Fu) | (((Z >> 4) & 0x03030303u) << 4);
        q[k][3] = ((B >> 4) & 0x0F0F0F0Fu) | (((Z >> 6) & 0x03030303u) << 4);
    }
}

template <>
__device__ __forceinline__ float chunk_dot<W6_K>(const u8* b, int j, const float* xv, const float*) {
    int l0 = 8 * (j & 3);
    unsigned q[2][4], sw[2];
    q6_levels(b, j, q, sw);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int k = 0; k < 2; k++)
#pragma unroll
        for (int r = 0; r < 4; r++) acc[r] = q_dot4(q[k][r], 8388640.f, xv + 8 * r + 4 * k, acc[r]);  // q - 32
    float d = q_half(b + 208), s = 0.f;
#pragma unroll
    for (int r = 0; r < 4; r++) {
        int at = 2 * r + (l0 >> 4);  // scale bytes 0..7: words by a select, not an index
        s += (float)(signed char)q_byte(at < 4 ? sw[0] : sw[1], at & 3) * acc[r];
    }
    return d * s;
}

// The 32 activations of chunk j of block b (runs at W::cols, 16-byte aligned) and, where the type
// needs them, their two half sums.
template <class W>
__device__ __forceinline__ void chunk_x(const float* __restrict__ xb, int j, float* xv, float* xs) {
    int c[4];
    W::cols(j, c);
#pragma unroll
    for (int q = 0; q < 4; q++) {
        float4 lo = *(const float4*)(xb + c[q]), hi = *(const float4*)(xb + c[q] + 4);
        xv[8 * q] = lo.x, xv[8 * q + 1] = lo.y, xv[8 * q + 2] = lo.z, xv[8 * q + 3] = lo.w;
        xv[8 * q + 4] = hi.x, xv[8 * q + 5] = hi.y, xv[8 * q + 6] = hi.z, xv[8 * q + 7] = hi.w;
    }
    if (NeedsXSum<W>::value) {
        float s0 = 0.f, s1 = 0.f;
#pragma unroll
        for (int i = 0; i < 16; i++) s0 += xv[i], s1 += xv[16 + i];
        xs[0] = s0, xs[1] = s1;
    }
}

// R rows of W blocks (K values each) . x (16-byte aligned) with one warp: out[r] in every lane.
// Each lane takes chunks lane, lane + 32, ...; the x values of a chunk are loaded once for all
// rows.
template <class W, int R>
__device__ __forceinline__ void warp_dot_wide(const u8* const* rows, const float* __restrict__ x, int K,
                                              float* out) {
    int lane = threadIdx.x & 31, nch = K / W::ELEMS * W::CHUNKS;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.f;
    for (int g = lane; g < nch; g += WARP) {
        int b = g / W::CHUNKS, j = g % W::CHUNKS;
        float xv[32], xs[2];
        chunk_x<W>(x + (size_t)b * W::ELEMS, j, xv, xs);
#pragma unroll
        for (int r = 0; r < R; r++) acc[r] += chunk_dot<W>(rows[r] + (size_t)b * W::BYTES, j, xv, xs);
    }
#pragma unroll
    for (int r = 0; r < R; r++) out[r] = warp_sum(acc[r]);
}

// One down-projection output row r over a token's entries e0..e1 of a typed cache: the warp's
// lanes take (entry, chunk) pairs of all entries at once (independent loads, one reduction).
template <class W>
__device__ __forceinline__ float down_entries(const u8* __restrict__ D, int row_bytes, const float* __restrict__ h,
                                              const int* __restrict__ slots, const float* __restrict__ weights,
                                              int e0, int e1, int r, int hidden, int ff) {
    int nch = ff / W::ELEMS * W::CHUNKS, total = (e1 - e0) * nch;
    float acc = 0.f;
#pragma unroll 4
    for (int g = threadIdx.x & 31; g < total; g += WARP) {
        int e = e0 + g / nch, gc = g % nch, b = gc / W::CHUNKS, j = gc % W::CHUNKS, slot = slots[e];
        if (slot >= 0) {  // else a cold entry (device-built worklist); predicated, so loads overlap
            const u8* row = D + ((size_t)slot * hidden + r) * row_bytes + (size_t)b * W::BYTES;
            float xv[32], xs[2];
            chunk_x<W>(h + (size_t)e * ff + (size_t)b * W::ELEMS, j, xv, xs);
            acc = fmaf(weights[e], chunk_dot<W>(row, j, xv, xs), acc);
        }
    }
    return warp_sum(acc);
}

__device__ __forceinline__ float4 q_load_x4(const float* p, bool aligned) {
    return aligned ? *(const float4*)p : make_float4(p[0], p[1], p[2], p[3]);
}

// y[t, n] = (accumulate ? y[t, n] : 0) + W[n, :] . x[t, :] for t < T <= QUANT_MAX_TOKENS. One warp
// per output row walks the row's blocks (32 / LANES blocks per step, each lane one unit) and
// multiplies every decoded value with all T activation rows, so each weight byte is read once.
template <class Q>
__device__ __forceinline__ void gemv_q(const u8* __restrict__ W, const float* __restrict__ x,
                                       float* __restrict__ y, int N, int K, int T, int accumulate) {
    int n = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
    if (n >= N) return;
    int lane = threadIdx.x & 31, nb = K / Q::ELEMS;
    const u8* row = W + (size_t)n * nb * Q::BYTES;
    bool aligned = (((size_t)x) & 15) == 0;
    float acc[QUANT_MAX_TOKENS];
#pragma unroll
    for (int t = 0; t < QUANT_MAX_TOKENS; t++) acc[t] = 0.f;
    for (int b = lane / Q::LANES; b < nb; b += WARP / Q::LANES) {
        float v[8];
        int c0, c1;
        Q::unit(row + (size_t)b * Q::BYTES, lane % Q::LANES, v, c0, c1);
        const float* xb = x + (size_t)b * Q::ELEMS;
#pragma unroll
        for (int t = 0; t < QUANT_MAX_TOKENS; t++) {
            if (t < T) {
                float4 a = q_load_x4(xb + (size_t)t * K + c0, aligned);
                float4 c = q_load_x4(xb + (size_t)t * K + c1, aligned);
                acc[t] += v[0] * a.x + v[1] * a.y + v[2] * a.z + v[3] * a.w;
                acc[t] += v[4] * c.x + v[5] * c.y + v[6] * c.z + v[7] * c.w;
            }
        }
    }
#pragma unroll
    for (int t = 0; t < QUANT_MAX_TOKENS; t++) {
        if (t < T) {
            float d = warp_sum(acc[t]);
            if (lane == 0) {
                float* o = y + (size_t)t * N + n;
                *o = accumulate ? *o + d : d;
            }
        }
    }
}

__device__ __forceinline__ void q_store_bf16x4(bf16* o, const float* v, bool aligned) {
    if (aligned) {
        __nv_bfloat162 p[2] = {__floats2bfloat162_rn(v[0], v[1]), __floats2bfloat162_rn(v[2], v[3])};
        *(uint2*)o = *(const uint2*)p;
    } else {
        for (int i = 0; i < 4; i++) o[i] = __float2bfloat16_rn(v[i]);
    }
}

// out[i] = bf16(value i) over n_blocks consecutive blocks (a row range of a matrix: its rows are
// consecutive blocks, so block k's values land at out[k * ELEMS ...]). One thread per unit.
template <class Q>
__device__ __forceinline__ void dequant_q(const u8* __restrict__ W, bf16* __restrict__ out, int n_blocks) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n_blocks * Q::LANES) return;
    long long blk = i / Q::LANES;
    float v[8];
    int c0, c1;
    Q::unit(W + blk * Q::BYTES, (int)(i % Q::LANES), v, c0, c1);
    bf16* o = out + blk * Q::ELEMS;
    bool aligned = (((size_t)out) & 7) == 0;
    q_store_bf16x4(o + c0, v, aligned);
    q_store_bf16x4(o + c1, v + 4, aligned);
}

// GEMV entry points: grid (ceil(N / ROWS_PER_BLOCK)), block 32 * ROWS_PER_BLOCK; W bytes of N rows.
extern "C" __global__ void gemv_q8_0(const u8* W, const float* x, float* y, int N, int K, int T, int accumulate) {
    pdl_enter();
    gemv_q<Q8_0>(W, x, y, N, K, T, accumulate);
}
extern "C" __global__ void gemv_q4_0(const u8* W, const float* x, float* y, int N, int K, int T, int accumulate) {
    pdl_enter();
    gemv_q<Q4_0>(W, x, y, N, K, T, accumulate);
}
extern "C" __global__ void gemv_q4_k(const u8* W, const float* x, float* y, int N, int K, int T, int accumulate) {
    pdl_enter();
    gemv_q<Q4_K>(W, x, y, N, K, T, accumulate);
}
extern "C" __global__ void gemv_q5_k(const u8* W, const float* x, float* y, int N, int K, int T, int accumulate) {
    pdl_enter();
    gemv_q<Q5_K>(W, x, y, N, K, T, accumulate);
}
extern "C" __global__ void gemv_q6_k(const u8* W, const float* x, float* y, int N, int K, int T, int accumulate) {
    pdl_enter();
    gemv_q<Q6_K>(W, x, y, N, K, T, accumulate);
}
extern "C" __global__ void gemv_mxfp4(const u8* W, const float* x, float* y, int N, int K, int T, int accumulate) {
    pdl_enter();
    gemv_q<QMX>(W, x, y, N, K, T, accumulate);
}
extern "C" __global__ void gemv_q5_0(const u8* W, const float* x, float* y, int N, int K, int T, int accumulate) {
    pdl_enter();
    gemv_q<Q5_0>(W, x, y, N, K, T, accumulate);
}
extern "C" __global__ void gemv_q5_1(const u8* W, const float* x, float* y, int N, int K, int T, int accumulate) {
    pdl_enter();
    gemv_q<Q5_1>(W, x, y, N, K, T, accumulate);
}
extern "C" __global__ void gemv_iq4_nl(const u8* W, const float* x, float* y, int N, int K, int T, int accumulate) {
    pdl_enter();
    gemv_q<QNL>(W, x, y, N, K, T, accumulate);
}

// Dequantization entry points: grid (ceil(n_blocks * LANES / 256)), block 256.
extern "C" __global__ void dequant_q8_0_bf16(const u8* W, bf16* out, int n_blocks) {
    pdl_enter();
    dequant_q<Q8_0>(W, out, n_blocks);
}
extern "C" __global__ void dequant_q4_0_bf16(const u8* W, bf16* out, int n_blocks) {
    pdl_enter();
    dequant_q<Q4_0>(W, out, n_blocks);
}
extern "C" __global__ void dequant_q4_k_bf16(const u8* W, bf16* out, int n_blocks) {
    pdl_enter();
    dequant_q<Q4_K>(W, out, n_blocks);
}
extern "C" __global__ void dequant_q5_k_bf16(const u8* W, bf16* out, int n_blocks) {
    pdl_enter();
    dequant_q<Q5_K>(W, out, n_blocks);
}
extern "C" __global__ void dequant_q6_k_bf16(const u8* W, bf16* out, int n_blocks) {
    pdl_enter();
    dequant_q<Q6_K>(W, out, n_blocks);
}
extern "C" __global__ void dequant_mxfp4_bf16(const u8* W, bf16* out, int n_blocks) {
    pdl_enter();
    dequant_q<QMX>(W, out, n_blocks);
}
extern "C" __global__ void dequant_q5_0_bf16(const u8* W, bf16* out, int n_blocks) {
    pdl_enter();
    dequant_q<Q5_0>(W, out, n_blocks);
}
extern "C" __global__ void dequant_q5_1_bf16(const u8* W, bf16* out, int n_blocks) {
    pdl_enter();
    dequant_q<Q5_1>(W, out, n_blocks);
}
extern "C" __global__ void dequant_iq4_nl_bf16(const u8* W, bf16* out, int n_blocks) {
    pdl_enter();
    dequant_q<QNL>(W, out, n_blocks);
}

// ---- 8-bit activations: integer chunk dots (llama.cpp's MMVQ idea; kernels/src/q8.rs) ----
// x quantized per block of 32 values as the CPU's Q8Activations does, bit for bit: d = max|x| /
// 127, q = round-to-even(x * (127 / max|x|)). A chunk's dot then multiplies the raw weight
// levels with q four bytes an instruction (dp4a, exact in int32) and applies the weight's scale
// (and min) times d once per run of equal scales. Against the f32 chunk dots a lane loads 32
// bytes of x per 32 values instead of 128 and issues about a quarter of the arithmetic. The
// rounding of x is the only error beyond f32 order: kernels/src/q8.rs states its bound.

// x [n_blocks * 32] in 8 bits, q like x and d per block, as the CPU's Q8Activations, bit for
// bit: d = max|x| / 127, q = x * (127 / max|x|) rounded to nearest even. (Written by the
// producers of a GEMV's input instead, this measured slower: their latency grew by more than the
// launch saved.) grid ceil(n_blocks * 32 / 256), block 256: a warp a block, a value a lane.
extern "C" __global__ void quantize_q8_f32(const float* __restrict__ x, signed char* __restrict__ q,
                                           float* __restrict__ d, int n_blocks) {
    pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if ((i >> 5) >= n_blocks) return;  // whole warps
    float v = x[i], amax = warp_max(fabsf(v));
    float id = amax > 0.f ? 127.f / amax : 0.f;
    q[i] = (signed char)__float2int_rn(__fmul_rn(v, id));
    if ((threadIdx.x & 31) == 0) d[i >> 5] = amax > 0.f ? amax / 127.f : 0.f;
}

// A chunk's quantized x: 8 words of 4 values in W::cols order (runs of 8 at cols[0..4]) and the
// d of each run's block of 32; xq / xd at the weight block's first column.
template <class W>
struct RunsOf16 {  // W::cols gives two runs of 16 columns (all but Q6_K)
    static constexpr bool value = true;
};
template <>
struct RunsOf16<W6_K> {
    static constexpr bool value = false;
};

template <class W>
__device__ __forceinline__ void chunk_xq(const signed char* __restrict__ xq, const float* __restrict__ xd, int j,
                                         int* x, float* dx) {
    int c[4];
    W::cols(j, c);
    if (RunsOf16<W>::value) {
        int4 a = *(const int4*)(xq + c[0]), b = *(const int4*)(xq + c[2]);
        x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
        dx[0] = dx[1] = xd[c[0] >> 5], dx[2] = dx[3] = xd[c[2] >> 5];
    } else {  // four runs of 8
#pragma unroll
        for (int r = 0; r < 4; r++) {
            int2 a = *(const int2*)(xq + c[r]);
            x[2 * r] = a.x, x[2 * r + 1] = a.y, dx[r] = xd[c[r] >> 5];
        }
    }
}

// Sums of 4 words of levels against 4 words of x, and of those x alone (the mins, offsets).
__device__ __forceinline__ int dp4x4(const unsigned* w, const int* x) {
    int s = 0;
#pragma unroll
    for (int k = 0; k < 4; k++) s = __dp4a((int)w[k], x[k], s);
    return s;
}
__device__ __forceinline__ int sum4x4(const int* x) {
    int s = 0;
#pragma unroll
    for (int k = 0; k < 4; k++) s = __dp4a(0x01010101, x[k], s);
    return s;
}

template <class W>
__device__ __forceinline__ float chunk_dot_q8(const u8* b, int j, const int* x, const float* dx);

template <>
__device__ __forceinline__ float chunk_dot_q8<W8_0>(const u8* b, int, const int* x, const float* dx) {
    unsigned w[8];
    q_words<8>(b + 2, w);
    return q_half(b) * dx[0] * (float)(dp4x4(w, x) + dp4x4(w + 4, x + 4));
}

template <>
__device__ __forceinline__ float chunk_dot_q8<W4_0>(const u8* b, int, const int* x, const float* dx) {
    unsigned w[4], lo[4], hi[4];
    q_words<4>(b + 2, w);
#pragma unroll
    for (int k = 0; k < 4; k++) lo[k] = w[k] & 0x0F0F0F0Fu, hi[k] = (w[k] >> 4) & 0x0F0F0F0Fu;
    int s = dp4x4(lo, x) + dp4x4(hi, x + 4) - 8 * (sum4x4(x) + sum4x4(x + 4));  // q - 8
    return q_half(b) * dx[0] * (float)s;
}

// MXFP4: signed levels against signed x (dp4a), one scale a block.
template <>
__device__ __forceinline__ float chunk_dot_q8<WMX>(const u8* b, int, const int* x, const float* dx) {
    unsigned lo[4], hi[4];
    WMX::levels(b, lo, hi);
    return mx_scale(b[0]) * dx[0] * (float)(dp4x4(lo, x) + dp4x4(hi, x + 4));
}

// Q5_0 / Q5_1: unsigned levels against signed x (dp4a); Q5_0's 16 and Q5_1's min through the
// integer sum of x.
template <>
__device__ __forceinline__ float chunk_dot_q8<W5_0>(const u8* b, int, const int* x, const float* dx) {
    unsigned lo[4], hi[4];
    W5_0::levels(b, lo, hi);
    int s = dp4x4(lo, x) + dp4x4(hi, x + 4) - 16 * (sum4x4(x) + sum4x4(x + 4));  // q - 16
    return q_half(b) * dx[0] * (float)s;
}

template <>
__device__ __forceinline__ float chunk_dot_q8<W5_1>(const u8* b, int, const int* x, const float* dx) {
    unsigned lo[4], hi[4];
    W5_1::levels(b, lo, hi);
    float dot = (float)(dp4x4(lo, x) + dp4x4(hi, x + 4)), xs = (float)(sum4x4(x) + sum4x4(x + 4));
    return dx[0] * (q_half(b) * dot + q_half(b + 2) * xs);
}

// IQ4_NL: signed levels against signed x (dp4a), one scale a block.
template <>
__device__ __forceinline__ float chunk_dot_q8<WNL>(const u8* b, int, const int* x, const float* dx) {
    unsigned lo[4], hi[4];
    WNL::levels(b, lo, hi);
    return q_half(b) * dx[0] * (float)(dp4x4(lo, x) + dp4x4(hi, x + 4));
}

// Q4_K / Q5_K chunk j as k_asym_dot reads it: x[0..4] are sub-block 2p's 16 columns, x[4..8]
// sub-block 2p + 1's.
template <bool FIFTH>
__device__ __forceinline__ float k_asym_dot_q8(const u8* b, int j, const int* x, const float* dx) {
    float s[2], n[2];
    unsigned lo[4], hi[4];
    k_asym_levels<FIFTH>(b, j, s, n, lo, hi);
    float r0 = s[0] * (float)dp4x4(lo, x) - n[0] * (float)sum4x4(x);
    float r1 = s[1] * (float)dp4x4(hi, x + 4) - n[1] * (float)sum4x4(x + 4);
    return dx[0] * r0 + dx[2] * r1;
}

template <>
__device__ __forceinline__ float chunk_dot_q8<W4_K>(const u8* b, int j, const int* x, const float* dx) {
    return k_asym_dot_q8<false>(b, j, x, dx);
}

template <>
__device__ __forceinline__ float chunk_dot_q8<W5_K>(const u8* b, int j, const int* x, const float* dx) {
    return k_asym_dot_q8<true>(b, j, x, dx);
}

// Q6_K chunk j as chunk_dot<W6_K> reads it: run r (x[2r], x[2r + 1]) is quarter r's 8 values.
template <>
__device__ __forceinline__ float chunk_dot_q8<W6_K>(const u8* b, int j, const int* x, const float* dx) {
    int l0 = 8 * (j & 3);
    unsigned q[2][4], sw[2];
    q6_levels(b, j, q, sw);
    int acc[4] = {0, 0, 0, 0};
#pragma unroll
    for (int k = 0; k < 2; k++)
#pragma unroll
        for (int r = 0; r < 4; r++)
            acc[r] = __dp4a((int)q[k][r], x[2 * r + k], acc[r]) - 32 * __dp4a(0x01010101, x[2 * r + k], 0);
    float s = 0.f;
#pragma unroll
    for (int r = 0; r < 4; r++) {
        int at = 2 * r + (l0 >> 4);
        s += (float)(signed char)q_byte(at < 4 ? sw[0] : sw[1], at & 3) * dx[r] * (float)acc[r];
    }
    return q_half(b + 208) * s;
}

// R rows of W blocks (K values each) . quantized x (xq 16-byte aligned, xd its block scales)
// with one warp: out[r] in every lane; the chunks as warp_dot_wide takes them, x loaded once for
// all rows.
template <class W, int R>
__device__ __forceinline__ void warp_dot_q8(const u8* const* rows, const signed char* __restrict__ xq,
                                            const float* __restrict__ xd, int K, float* out) {
    int lane = threadIdx.x & 31, nch = K / W::ELEMS * W::CHUNKS;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.f;
    for (int g = lane; g < nch; g += WARP) {
        int b = g / W::CHUNKS, j = g % W::CHUNKS, x[8];
        float dx[4];
        chunk_xq<W>(xq + (size_t)b * W::ELEMS, xd + (size_t)b * (W::ELEMS / 32), j, x, dx);
#pragma unroll
        for (int r = 0; r < R; r++) acc[r] += chunk_dot_q8<W>(rows[r] + (size_t)b * W::BYTES, j, x, dx);
    }
#pragma unroll
    for (int r = 0; r < R; r++) out[r] = warp_sum(acc[r]);
}

// warp_dot_q8 over a stored type chosen at run time (type codes as warp_dot_typed; quantized
// types only: bf16 rows keep f32 x).
template <int R>
__device__ __forceinline__ void warp_dot_q8_typed(int type, const u8* const* rows, const signed char* __restrict__ xq,
                                                  const float* __restrict__ xd, int K, float* out) {
    switch (type) {
        case 0: warp_dot_q8<W8_0, R>(rows, xq, xd, K, out); break;
        case 1: warp_dot_q8<W4_0, R>(rows, xq, xd, K, out); break;
        case 2: warp_dot_q8<W4_K, R>(rows, xq, xd, K, out); break;
        case 3: warp_dot_q8<W5_K, R>(rows, xq, xd, K, out); break;
        case 6: warp_dot_q8<WMX, R>(rows, xq, xd, K, out); break;
        case 7: warp_dot_q8<W5_0, R>(rows, xq, xd, K, out); break;
        case 8: warp_dot_q8<W5_1, R>(rows, xq, xd, K, out); break;
        case 9: warp_dot_q8<WNL, R>(rows, xq, xd, K, out); break;
        default: warp_dot_q8<W6_K, R>(rows, xq, xd, K, out); break;
    }
}

// down_entries over the entries' 8-bit h rows (hq [entries, ff], hd their block scales).
template <class W>
__device__ __forceinline__ float down_entries_q8(const u8* __restrict__ D, int row_bytes,
                                                 const signed char* __restrict__ hq, const float* __restrict__ hd,
                                                 const int* __restrict__ slots, const float* __restrict__ weights,
                                                 int e0, int e1, int r, int hidden, int ff) {
    int nch = ff / W::ELEMS * W::CHUNKS, total = (e1 - e0) * nch;
    float acc = 0.f;
#pragma unroll 4
    for (int g = threadIdx.x & 31; g < total; g += WARP) {
        int e = e0 + g / nch, gc = g % nch, b = gc / W::CHUNKS, j = gc % W::CHUNKS, slot = slots[e];
        if (slot >= 0) {  // else a cold entry (device-built worklist)
            const u8* row = D + ((size_t)slot * hidden + r) * row_bytes + (size_t)b * W::BYTES;
            size_t c0 = (size_t)e * ff + (size_t)b * W::ELEMS;
            int x[8];
            float dx[4];
            chunk_xq<W>(hq + c0, hd + c0 / 32, j, x, dx);
            acc = fmaf(weights[e], chunk_dot_q8<W>(row, j, x, dx), acc);
        }
    }
    return warp_sum(acc);
}

// ---- the hot lane over caches of any block type ----
// Type codes (kernels/src/cuda/quant.rs, `type_code`): 0 Q8_0, 1 Q4_0, 2 Q4_K, 3 Q5_K, 4 Q6_K,
// 5 bf16, 6 MXFP4, 7 Q5_0, 8 Q5_1, 9 IQ4_NL. A cache is [n_slots, rows, K] in its type: row r of slot s at (s * rows + r) * row_bytes.

// R rows of one stored type (chosen at run time, uniform over the warp: no divergence) . x,
// one warp, out[r] in every lane. Quantized rows take the wide chunks (x 16-byte aligned; Q4_K /
// Q5_K rows 16-byte aligned: the launchers check both), over the 8-bit x (xq, xd) when Q8; bf16
// rows always take the f32 x. The 8-bit kernels are entry points of their own (_q8), each
// compiled for its path alone. (Capped at fewer registers for more warps an SM they spilled:
// 6 blocks an SM made the Q4_K_M decode 30% slower.)
template <int R, bool Q8>
__device__ __forceinline__ void warp_dot_typed(int type, const u8* const* rows, const float* __restrict__ x,
                                               const signed char* __restrict__ xq, const float* __restrict__ xd,
                                               int K, float* out) {
    if (Q8 && type != 5) {
        warp_dot_q8_typed<R>(type, rows, xq, xd, K, out);
        return;
    }
    if (Q8) {
#pragma unroll
        for (int r = 0; r < R; r++) out[r] = warp_dot_bf16((const bf16*)rows[r], x, K);
        return;
    }
    switch (type) {
        case 0: warp_dot_wide<W8_0, R>(rows, x, K, out); break;
        case 1: warp_dot_wide<W4_0, R>(rows, x, K, out); break;
        case 2: warp_dot_wide<W4_K, R>(rows, x, K, out); break;
        case 3: warp_dot_wide<W5_K, R>(rows, x, K, out); break;
        case 4: warp_dot_wide<W6_K, R>(rows, x, K, out); break;
        case 6: warp_dot_wide<WMX, R>(rows, x, K, out); break;
        case 7: warp_dot_wide<W5_0, R>(rows, x, K, out); break;
        case 8: warp_dot_wide<W5_1, R>(rows, x, K, out); break;
        case 9: warp_dot_wide<WNL, R>(rows, x, K, out); break;
        default:
#pragma unroll
            for (int r = 0; r < R; r++) out[r] = warp_dot_bf16((const bf16*)rows[r], x, K);
    }
}

// Hot lane decode, first half, as moe_gate_up_gemv over typed caches [n_slots, ff, hidden]:
// h[e, r] = glu(act, G_s[r] . x_t + bg[s, r], U_s[r] . x_t + bu[s, r]), slot s = slots[e] (-1:
// cold, skipped), t = tokens[e] (bg, bu per-slot biases [n_slots, ff], null: none); with Q8 the
// quantized rows read x's 8-bit rows (xq, xd).
template <bool Q8>
__device__ __forceinline__ void gate_up_typed(const u8* __restrict__ G, const u8* __restrict__ U, int g_type,
                                              int u_type, int g_row_bytes, int u_row_bytes,
                                              const float* __restrict__ x, const signed char* __restrict__ xq,
                                              const float* __restrict__ xd, const int* __restrict__ slots,
                                              const int* __restrict__ tokens, float* __restrict__ h, int ff,
                                              int hidden, int act, const float* __restrict__ bg,
                                              const float* __restrict__ bu) {
    int r = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
    int e = blockIdx.y;
    if (r >= ff || slots[e] < 0) return;
    size_t row = (size_t)slots[e] * ff + r, t = (size_t)tokens[e];
    const float* xt = x + t * hidden;
    const signed char* qt = Q8 ? xq + t * hidden : nullptr;
    const float* dt = Q8 ? xd + t * (hidden / 32) : nullptr;
    const u8* rows[2] = {G + row * g_row_bytes, U + row * u_row_bytes};
    float gu[2];
    if (g_type == u_type) {
        warp_dot_typed<2, Q8>(g_type, rows, xt, qt, dt, hidden, gu);  // gate and up share the loads of x
    } else {
        warp_dot_typed<1, Q8>(g_type, rows, xt, qt, dt, hidden, gu);
        warp_dot_typed<1, Q8>(u_type, rows + 1, xt, qt, dt, hidden, gu + 1);
    }
    if ((threadIdx.x & 31) == 0) h[(size_t)e * ff + r] = glu_biased(act, gu[0], gu[1], bg, bu, slots[e], r, ff);
}

// gate_up_typed entry points (xq, xd unused without Q8). grid (ceil(ff/ROWS_PER_BLOCK),
// n_entries), block 32 * ROWS_PER_BLOCK: one warp per ff row.
#define GATE_UP_PARAMS                                                                                         \
    const u8 *__restrict__ G, const u8 *__restrict__ U, int g_type, int u_type, int g_row_bytes, int u_row_bytes, \
        const float *__restrict__ x, const signed char *__restrict__ xq, const float *__restrict__ xd,           \
        const int *__restrict__ slots, const int *__restrict__ tokens, float *__restrict__ h, int ff, int hidden, \
        int act, const float *__restrict__ bg, const float *__restrict__ bu
#define GATE_UP_ARGS G, U, g_type, u_type, g_row_bytes, u_row_bytes, x, xq, xd, slots, tokens, h, ff, hidden, act, bg, bu
extern "C" __global__ __launch_bounds__(32 * ROWS_PER_BLOCK, QUANT_MIN_BLOCKS) void moe_gate_up_gemv_q(GATE_UP_PARAMS) {
    pdl_enter();
    gate_up_typed<false>(GATE_UP_ARGS);
}
extern "C" __global__ __launch_bounds__(32 * ROWS_PER_BLOCK, QUANT_MIN_BLOCKS) void moe_gate_up_gemv_q8(GATE_UP_PARAMS) {
    pdl_enter();
    gate_up_typed<true>(GATE_UP_ARGS);
}

// Hot lane decode, second half, as moe_down_accum over a typed cache [n_slots, hidden, ff]:
// output row i (token tok_rows[i], entries tok_off[i]..tok_off[i+1]) adds
// sum_e weights[e] * (D_{slots[e]}[r] . h[e] + bd[slots[e], r]) (bd per-slot down biases
// [n_slots, hidden], null: none; the weighted biases summed after the products); deterministic
// (no atomics); with Q8 quantized rows read h's 8-bit rows (hq, hd).
template <bool Q8>
__device__ __forceinline__ void down_typed(const u8* __restrict__ D, int d_type, int d_row_bytes,
                                            const float* __restrict__ h, const signed char* __restrict__ hq,
                                            const float* __restrict__ hd, const int* __restrict__ slots,
                                            const float* __restrict__ weights, const int* __restrict__ tok_off,
                                            const int* __restrict__ tok_rows, float* __restrict__ out, int hidden,
                                            int ff, const float* __restrict__ bd) {
    int r = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
    int i = blockIdx.y;
    if (r >= hidden) return;
    int e0 = tok_off[i], e1 = tok_off[i + 1];
    float acc = 0.f;
#define DOWN_ENTRIES(W)                                                                    \
    (Q8 ? down_entries_q8<W>(D, d_row_bytes, hq, hd, slots, weights, e0, e1, r, hidden, ff) \
        : down_entries<W>(D, d_row_bytes, h, slots, weights, e0, e1, r, hidden, ff))
    switch (d_type) {
        case 0: acc = DOWN_ENTRIES(W8_0); break;
        case 1: acc = DOWN_ENTRIES(W4_0); break;
        case 2: acc = DOWN_ENTRIES(W4_K); break;
        case 3: acc = DOWN_ENTRIES(W5_K); break;
        case 4: acc = DOWN_ENTRIES(W6_K); break;
        case 6: acc = DOWN_ENTRIES(WMX); break;
        case 7: acc = DOWN_ENTRIES(W5_0); break;
        case 8: acc = DOWN_ENTRIES(W5_1); break;
        case 9: acc = DOWN_ENTRIES(WNL); break;
        default:
            for (int e = e0; e < e1; e++) {
                if (slots[e] < 0) continue;  // cold entry (device-built worklist)
                const bf16* row = (const bf16*)(D + ((size_t)slots[e] * hidden + r) * d_row_bytes);
                acc += weights[e] * warp_dot_bf16(row, h + (size_t)e * ff, ff);
            }
    }
#undef DOWN_ENTRIES
    if (bd)
        for (int e = e0; e < e1; e++)
            if (slots[e] >= 0) acc += weights[e] * bd[(size_t)slots[e] * hidden + r];
    if ((threadIdx.x & 31) == 0) out[(size_t)tok_rows[i] * hidden + r] += acc;
}

// down_typed entry points (hq, hd unused without Q8). grid (ceil(hidden/ROWS_PER_BLOCK),
// n_rows), block 32 * ROWS_PER_BLOCK.
#define DOWN_PARAMS                                                                                             \
    const u8 *__restrict__ D, int d_type, int d_row_bytes, const float *__restrict__ h,                           \
        const signed char *__restrict__ hq, const float *__restrict__ hd, const int *__restrict__ slots,          \
        const float *__restrict__ weights, const int *__restrict__ tok_off, const int *__restrict__ tok_rows,     \
        float *__restrict__ out, int hidden, int ff, const float *__restrict__ bd
#define DOWN_ARGS D, d_type, d_row_bytes, h, hq, hd, slots, weights, tok_off, tok_rows, out, hidden, ff, bd
extern "C" __global__ __launch_bounds__(32 * ROWS_PER_BLOCK, QUANT_MIN_BLOCKS) void moe_down_accum_q(DOWN_PARAMS) {
    pdl_enter();
    down_typed<false>(DOWN_ARGS);
}
extern "C" __global__ __launch_bounds__(32 * ROWS_PER_BLOCK, QUANT_MIN_BLOCKS) void moe_down_accum_q8(DOWN_PARAMS) {
    pdl_enter();
    down_typed<true>(DOWN_ARGS);
}

// One embedding row of Q blocks as f32 (the CPU's dequantized values exactly), block-wide.
template <class Q>
__device__ __forceinline__ void embed_row_q(const u8* __restrict__ row, float* __restrict__ out, int hidden) {
    int units = hidden / Q::ELEMS * Q::LANES;
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
        int b = u / Q::LANES, c0, c1;
        float v[8];
        Q::unit(row + (size_t)b * Q::BYTES, u % Q::LANES, v, c0, c1);
        float* o = out + (size_t)b * Q::ELEMS;
#pragma unroll
        for (int i = 0; i < 4; i++) o[c0 + i] = v[i], o[c1 + i] = v[4 + i];
    }
}

// out[t, :] = row tokens[t] of a table in any stored type (type codes as warp_dot_typed), widened
// to f32. Token ids must be checked by the caller. grid (n_tokens), block 256.
extern "C" __global__ void embed_q(const u8* __restrict__ table, int type, int row_bytes,
                                   const int* __restrict__ tokens, float* __restrict__ out, int hidden) {
    pdl_enter();
    const u8* row = table + (size_t)tokens[blockIdx.x] * row_bytes;
    float* o = out + (size_t)blockIdx.x * hidden;
    switch (type) {
        case 0: embed_row_q<Q8_0>(row, o, hidden); break;
        case 1: embed_row_q<Q4_0>(row, o, hidden); break;
        case 2: embed_row_q<Q4_K>(row, o, hidden); break;
        case 3: embed_row_q<Q5_K>(row, o, hidden); break;
        case 4: embed_row_q<Q6_K>(row, o, hidden); break;
        case 6: embed_row_q<QMX>(row, o, hidden); break;
        case 7: embed_row_q<Q5_0>(row, o, hidden); break;
        case 8: embed_row_q<Q5_1>(row, o, hidden); break;
        case 9: embed_row_q<QNL>(row, o, hidden); break;
        default:
            for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = __bfloat162float(((const bf16*)row)[i]);
    }
}

// One-token GEMV, y[n] = (accumulate ? y[n] : 0) + W[n, :] . x: a warp takes R rows with the
// wide chunks (x 16-byte aligned; Q4_K / Q5_K matrices 16-byte aligned). Each row's sum is the
// same for any R (R only shares the loads of x).
template <class W, int R>
__device__ __forceinline__ void gemv1_rows(const u8* __restrict__ Wm, const float* __restrict__ x,
                                           float* __restrict__ y, int N, int K, int accumulate) {
    int n0 = (blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5)) * R;
    if (n0 >= N) return;
    size_t row_bytes = (size_t)(K / W::ELEMS) * W::BYTES;
    const u8* rows[R];
#pragma unroll
    for (int r = 0; r < R; r++) rows[r] = Wm + (size_t)min(n0 + r, N - 1) * row_bytes;
    float out[R];
    warp_dot_wide<W, R>(rows, x, K, out);
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int r = 0; r < R; r++)
            if (n0 + r < N) y[n0 + r] = accumulate ? y[n0 + r] + out[r] : out[r];
    }
}

// gemv1_rows with R = 1 (wide == 1: small matrices, twice the warps) or QUANT_WIDE_ROWS.
// grid ceil(N / (ROWS_PER_BLOCK * R)), block 32 * ROWS_PER_BLOCK.
template <class W>
__device__ __forceinline__ void gemv1_q(const u8* __restrict__ Wm, const float* __restrict__ x, float* __restrict__ y,
                                        int N, int K, int accumulate, int wide) {
    if (wide == 1)
        gemv1_rows<W, 1>(Wm, x, y, N, K, accumulate);
    else
        gemv1_rows<W, QUANT_WIDE_ROWS>(Wm, x, y, N, K, accumulate);
}
extern "C" __global__ __launch_bounds__(32 * ROWS_PER_BLOCK, QUANT_MIN_BLOCKS) void gemv1_q8_0(const u8* W, const float* x, float* y, int N, int K, int accumulate, int wide) {
    pdl_enter();
    gemv1_q<W8_0>(W, x, y, N, K, accumulate, wide);
}
extern "C" __global__ __launch_bounds__(32 * ROWS_PER_BLOCK, QUANT_MIN_BLOCKS) void gemv1_q4_0(const u8* W, const float* x, float* y, int N, int K, int accumulate, int wide) {
    pdl_enter();
    gemv1_q<W4_0>(W, x, y, N, K, accumulate, wide);
}
extern "C" __global__ __launch_bounds__(32 * ROWS_PER_BLOCK, QUANT_MIN_BLOCKS) void gemv1_q4_k(const u8* W, const float* x, float* y, int N, int K, int accumulate, int wide) {
    pdl_enter();
    gemv1_q<W4_K>(W, x, y, N, K, accumulate, wide);
}
extern "C" __global__ __launch_bounds__(32 * ROWS_PER_BLOCK, QUANT_MIN_BLOCKS) void gemv1_q5_k(const u8* W, const float* x, float* y, int N, int K, int accumulate, int wide) {
    pdl_enter();
    gemv1_q<W5_K>(W, x, y, N, K, accumulate, wide);
}
extern "C" __global__ __launch_bounds__(32 * ROWS_PER_BLOCK, QUANT_MIN_BLOCKS) void gemv1_q6_k(const u8* W, const float* x, float* y, int N, int K, int accumulate, int wide) {
    pdl_enter();
    gemv1_q<W6_K>(W, x, y, N, K, accumulate, wide);
}
extern "C" __global__ __launch_bounds__(32 * ROWS_PER_BLOCK, QUANT_MIN_BLOCKS) void gemv1_mxfp4(const u8* W, const float* x, float* y, int N, int K, int accumulate, int wide) {
    pdl_enter();
    gemv1_q<WMX>(W, x, y, N, K, accumulate, wide);
}
extern "C" __global__ __launch_bounds__(32 * ROWS_PER_BLOCK, QUANT_MIN_BLOCKS) void gemv1_q5_0(const u8* W, const float* x, float* y, int N, int K, int accumulate, int wide) {
    pdl_enter();
    gemv1_q<W5_0>(W, x, y, N, K, accumulate, wide);
}
extern "C" __global__ __launch_bounds__(32 * ROWS_PER_BLOCK, QUANT_MIN_BLOCKS) void gemv1_q5_1(const u8* W, const float* x, float* y, int N, int K, int accumulate, int wide) {
    pdl_enter();
    gemv1_q<W5_1>(W, x, y, N, K, accumulate, wide);
}
extern "C" __global__ __launch_bounds__(32 * ROWS_PER_BLOCK, QUANT_MIN_BLOCKS) void gemv1_iq4_nl(const u8* W, const float* x, float* y, int N, int K, int accumulate, int wide) {
    pdl_enter();
    gemv1_q<WNL>(W, x, y, N, K, accumulate, wide);
}

// gemv1_q over 8-bit x (xq 16-byte aligned, xd its block scales), the type chosen at run time
// (codes as warp_dot_typed, quantized only). grid and block as gemv1_q.
extern "C" __global__ __launch_bounds__(32 * ROWS_PER_BLOCK, QUANT_MIN_BLOCKS) void gemv1_q8(
    const u8* __restrict__ Wm, int type, int row_bytes, const signed char* __restrict__ xq,
    const float* __restrict__ xd, float* __restrict__ y, int N, int K, int accumulate, int wide) {
    pdl_enter();
    int R = wide == 1 ? 1 : QUANT_WIDE_ROWS;
    int n0 = (blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5)) * R;
    if (n0 >= N) return;
    const u8* rows[QUANT_WIDE_ROWS];
#pragma unroll
    for (int r = 0; r < QUANT_WIDE_ROWS; r++) rows[r] = Wm + (size_t)min(n0 + r, N - 1) * row_bytes;
    float out[QUANT_WIDE_ROWS];
    if (R == 1)
        warp_dot_q8_typed<1>(type, rows, xq, xd, K, out);
    else
        warp_dot_q8_typed<QUANT_WIDE_ROWS>(type, rows, xq, xd, K, out);
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int r = 0; r < QUANT_WIDE_ROWS; r++)
            if (r < R && n0 + r < N) y[n0 + r] = accumulate ? y[n0 + r] + out[r] : out[r];
    }
}

// warp_dot_q8 of one row against T <= QUANT_MAX_TOKENS tokens' 8-bit rows (xq [T, K], xd
// [T, K / 32]): the chunk loop of warp_dot_q8 with the tokens inside it, so each chunk of W is
// loaded and unpacked once (the first token's loads serve the others: nothing is stored in the
// loop) and token t's sum is warp_dot_q8's for that token alone, in its order.
template <class W>
__device__ __forceinline__ void warp_dot_q8_tokens(const u8* __restrict__ row, const signed char* __restrict__ xq,
                                                   const float* __restrict__ xd, int K, int T, float* out) {
    int lane = threadIdx.x & 31, nch = K / W::ELEMS * W::CHUNKS;
    float acc[QUANT_MAX_TOKENS];
#pragma unroll
    for (int t = 0; t < QUANT_MAX_TOKENS; t++) acc[t] = 0.f;
    for (int g = lane; g < nch; g += WARP) {
        int b = g / W::CHUNKS, j = g % W::CHUNKS;
        const u8* blk = row + (size_t)b * W::BYTES;
#pragma unroll
        for (int t = 0; t < QUANT_MAX_TOKENS; t++) {
            if (t == 0 || t < T) {
                int x[8];
                float dx[4];
                size_t c0 = (size_t)t * K + (size_t)b * W::ELEMS;
                chunk_xq<W>(xq + c0, xd + c0 / 32, j, x, dx);
                acc[t] += chunk_dot_q8<W>(blk, j, x, dx);
            }
        }
    }
#pragma unroll
    for (int t = 0; t < QUANT_MAX_TOKENS; t++) out[t] = warp_sum(acc[t]);
}

// y[t, n] (+)= W[n, :] . x_t for T <= QUANT_MAX_TOKENS tokens in their 8-bit form: gemv1_q8's
// sums (R = 1) with every token's dot product taken from one pass over W (a batched decode step's
// rows read each weight once, not once a token; `Device::gemv_q8` keeps prefill chunks f32). Quantized types only (codes as
// warp_dot_typed). grid ceil(N / ROWS_PER_BLOCK), block 32 * ROWS_PER_BLOCK: a warp a row.
extern "C" __global__ __launch_bounds__(32 * ROWS_PER_BLOCK, QUANT_MIN_BLOCKS) void gemv_q8_tokens(
    const u8* __restrict__ Wm, int type, int row_bytes, const signed char* __restrict__ xq,
    const float* __restrict__ xd, float* __restrict__ y, int N, int K, int T, int accumulate) {
    pdl_enter();
    int n = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
    if (n >= N) return;
    const u8* row = Wm + (size_t)n * row_bytes;
    float out[QUANT_MAX_TOKENS];
    switch (type) {
        case 0: warp_dot_q8_tokens<W8_0>(row, xq, xd, K, T, out); break;
        case 1: warp_dot_q8_tokens<W4_0>(row, xq, xd, K, T, out); break;
        case 2: warp_dot_q8_tokens<W4_K>(row, xq, xd, K, T, out); break;
        case 3: warp_dot_q8_tokens<W5_K>(row, xq, xd, K, T, out); break;
        case 6: warp_dot_q8_tokens<WMX>(row, xq, xd, K, T, out); break;
        case 7: warp_dot_q8_tokens<W5_0>(row, xq, xd, K, T, out); break;
        case 8: warp_dot_q8_tokens<W5_1>(row, xq, xd, K, T, out); break;
        case 9: warp_dot_q8_tokens<WNL>(row, xq, xd, K, T, out); break;
        default: warp_dot_q8_tokens<W6_K>(row, xq, xd, K, T, out); break;
    }
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int t = 0; t < QUANT_MAX_TOKENS; t++) {
            if (t < T) {
                float* o = y + (size_t)t * N + n;
                *o = accumulate ? *o + out[t] : out[t];
            }
        }
    }
}

// Decode q/k/v in one launch over matrices of any stored types (type codes as warp_dot_typed;
// bf16 segments too): segment j's warps take QUANT_WIDE_ROWS rows of W_j each (row_bytes rb_j)
// with warp_dot_typed, the dot products of gemv1_q (quantized) and gemv_bf16 (bf16), so the bits
// are theirs; y_j = W_j . x for one token (x 16-byte aligned; Q4_K / Q5_K matrices 16-byte
// aligned); with Q8 (gemv3_typed_q8) the quantized matrices read x's 8-bit form xq / xd
// (gemv1_q8's sums then).
// grid ceil((w_0 + w_1 + w_2) / ROWS_PER_BLOCK), w_j = ceil(N_j / QUANT_WIDE_ROWS);
// block 32 * ROWS_PER_BLOCK.
template <bool Q8>
__device__ __forceinline__ void gemv3_body(
    const u8* __restrict__ W0, const u8* __restrict__ W1, const u8* __restrict__ W2, int ty0, int ty1, int ty2,
    int rb0, int rb1, int rb2, const float* __restrict__ x, const signed char* __restrict__ xq,
    const float* __restrict__ xd, float* __restrict__ y0, float* __restrict__ y1,
    float* __restrict__ y2, int N0, int N1, int N2, int K) {
    int w = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
    int w0 = (N0 + QUANT_WIDE_ROWS - 1) / QUANT_WIDE_ROWS, w1 = (N1 + QUANT_WIDE_ROWS - 1) / QUANT_WIDE_ROWS;
    int w2 = (N2 + QUANT_WIDE_ROWS - 1) / QUANT_WIDE_ROWS;
    const u8* W;
    float* y;
    int N, ty, rb;
    if (w < w0) {
        W = W0, y = y0, N = N0, ty = ty0, rb = rb0;
    } else if (w < w0 + w1) {
        w -= w0, W = W1, y = y1, N = N1, ty = ty1, rb = rb1;
    } else if (w < w0 + w1 + w2) {
        w -= w0 + w1, W = W2, y = y2, N = N2, ty = ty2, rb = rb2;
    } else {
        return;
    }
    int n0 = w * QUANT_WIDE_ROWS;
    const u8* rows[QUANT_WIDE_ROWS];
#pragma unroll
    for (int r = 0; r < QUANT_WIDE_ROWS; r++) rows[r] = W + (size_t)min(n0 + r, N - 1) * rb;
    float out[QUANT_WIDE_ROWS];
    warp_dot_typed<QUANT_WIDE_ROWS, Q8>(ty, rows, x, xq, xd, K, out);
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int r = 0; r < QUANT_WIDE_ROWS; r++)
            if (n0 + r < N) y[n0 + r] = out[r];
    }
}
#define GEMV3_PARAMS                                                                                           \
    const u8 *__restrict__ W0, const u8 *__restrict__ W1, const u8 *__restrict__ W2, int ty0, int ty1, int ty2, \
        int rb0, int rb1, int rb2, const float *__restrict__ x, const signed char *__restrict__ xq,             \
        const float *__restrict__ xd, float *__restrict__ y0, float *__restrict__ y1, float *__restrict__ y2,    \
        int N0, int N1, int N2, int K
#define GEMV3_ARGS W0, W1, W2, ty0, ty1, ty2, rb0, rb1, rb2, x, xq, xd, y0, y1, y2, N0, N1, N2, K
extern "C" __global__ __launch_bounds__(32 * ROWS_PER_BLOCK, QUANT_MIN_BLOCKS) void gemv3_typed(GEMV3_PARAMS) {
    pdl_enter();
    gemv3_body<false>(GEMV3_ARGS);
}
extern "C" __global__ __launch_bounds__(32 * ROWS_PER_BLOCK, QUANT_MIN_BLOCKS) void gemv3_typed_q8(GEMV3_PARAMS) {
    pdl_enter();
    gemv3_body<true>(GEMV3_ARGS);
}

// ---- the prefill hot lane over typed caches: grouped_gemm.cu's tiles, weights decoded ----
// (compiled after grouped_gemm.cu; Family::Quant's standalone source puts it first)

// Eight values rounded to bf16, packed in a uint4.
__device__ __forceinline__ uint4 q_bf16x8(const float* v) {
    __nv_bfloat162 b[4];
#pragma unroll
    for (int i = 0; i < 4; i++) b[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    return *(const uint4*)b;
}

// Values k .. k + 7 of a row of `type` (k a multiple of 8, inside the row) as eight bf16 in a
// uint4, each the bf16 rounding of what dequant_q computes for it (Q::run8: the unit's operations).
__device__ __forceinline__ uint4 q_row_run8_bf16(int type, const u8* row, int k) {
    float v[8];
    switch (type) {
        case 0: Q8_0::run8(row + (k >> 5) * Q8_0::BYTES, k & 31, v); break;
        case 1: Q4_0::run8(row + (k >> 5) * Q4_0::BYTES, k & 31, v); break;
        case 2: Q4_K::run8(row + (k >> 8) * Q4_K::BYTES, k & 255, v); break;
        case 3: Q5_K::run8(row + (k >> 8) * Q5_K::BYTES, k & 255, v); break;
        case 4: Q6_K::run8(row + (k >> 8) * Q6_K::BYTES, k & 255, v); break;
        case 6: QMX::run8(row + (k >> 5) * QMX::BYTES, k & 31, v); break;
        case 7: Q5_0::run8(row + (k >> 5) * Q5_0::BYTES, k & 31, v); break;
        case 8: Q5_1::run8(row + (k >> 5) * Q5_1::BYTES, k & 31, v); break;
        case 9: QNL::run8(row + (k >> 5) * QNL::BYTES, k & 31, v); break;
        default: {
            const unsigned short* p = (const unsigned short*)row + k;
            return make_uint4(p[0] | ((unsigned)p[1] << 16), p[2] | ((unsigned)p[3] << 16),
                              p[4] | ((unsigned)p[5] << 16), p[6] | ((unsigned)p[7] << 16));
        }
    }
    return q_bf16x8(v);
}

// Weight tiles of typed caches [n_slots, N, K] (row r of slot s at (s * N + r) * row_bytes) for
// gg_tile: each thread decodes runs of 8 values straight into the bf16 tile (no bf16 copy of the
// slot in VRAM). Columns past N and K are zero.
struct GgTyped {
    const u8* W[2];
    int type[2], row_bytes[2];
    int N, K;
    __device__ __forceinline__ void load(bf16 (*sw)[GG_LD], int m, int slot, int col0, int k0) const {
        const u8* base = W[m] + (size_t)slot * N * row_bytes[m];
        for (int c = threadIdx.x; c < GG_BN * (GG_BK / 8); c += GG_THREADS) {
            int n = c / (GG_BK / 8), k = k0 + (c % (GG_BK / 8)) * 8;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (col0 + n < N && k < K) v = q_row_run8_bf16(type[m], base + (size_t)(col0 + n) * row_bytes[m], k);
            *(uint4*)&sw[n][k - k0] = v;
        }
    }
};

// grouped_gate_up_bf16 over typed caches (type codes as moe_gate_up_gemv_q): the same values
// as dequantizing the slots to bf16 and running it. grid (n_tiles, ceil(N / GG_BN)), GG_THREADS.
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gate_up_q(
    const u8* __restrict__ G, const u8* __restrict__ U, int g_type, int u_type, int g_row_bytes, int u_row_bytes,
    const float* __restrict__ x, const int* __restrict__ rows, int n_x_rows, const int* __restrict__ tiles,
    int n_rows, int n_slots, float* __restrict__ h, int N, int K, int split, int act, const float* __restrict__ bg,
    const float* __restrict__ bu) {
    pdl_enter();
    GgTyped wl = {{G, U}, {g_type, u_type}, {g_row_bytes, u_row_bytes}, N, K};
    gg_gate_up<true>(wl, x, rows, n_x_rows, tiles, n_rows, n_slots, h, N, K, split, act, bg, bu);
}

// grouped_gemm_bf16 over a typed cache [n_slots, N, K].
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gemm_q(
    const u8* __restrict__ W, int w_type, int row_bytes, const float* __restrict__ x, const int* __restrict__ rows,
    int n_x_rows, const int* __restrict__ tiles, int n_rows, int n_slots, float* __restrict__ y, int N, int K,
    int split, const float* __restrict__ b) {
    pdl_enter();
    GgTyped wl = {{W, W}, {w_type, w_type}, {row_bytes, row_bytes}, N, K};
    gg_gemm<true>(wl, x, rows, n_x_rows, tiles, n_rows, n_slots, y, N, K, split, b);
}

// gp_tile's loader over typed caches (grouped_gemm.cu's pipelined tiles): each thread decodes
// its chunks' runs of 8 values (q_row_run8_bf16, GgTyped's values) into the stage as it queues
// the stage's x copies; the decode's loads are synchronous, the x copies stay asynchronous.
// Columns past N and K are zeros.
template <int NW>
struct GpTyped {
    const u8* W[NW];
    int type[NW], row_bytes[NW];
    int N, K;
    const u8* row[NW][GP_W_CHUNKS];
    __device__ __forceinline__ void init(int slot, int col0) {
#pragma unroll
        for (int m = 0; m < NW; m++)
#pragma unroll
            for (int i = 0; i < GP_W_CHUNKS; i++) {
                int n = (threadIdx.x + i * GG_THREADS) / (GP_BK / 8);
                row[m][i] = col0 + n < N ? W[m] + ((size_t)slot * N + col0 + n) * row_bytes[m] : nullptr;
            }
    }
    __device__ __forceinline__ void load(bf16* sw, int K_, int k0) const {
#pragma unroll
        for (int m = 0; m < NW; m++)
#pragma unroll
            for (int i = 0; i < GP_W_CHUNKS; i++) {
                int c = threadIdx.x + i * GG_THREADS, n = c / (GP_BK / 8), kq = (c % (GP_BK / 8)) * 8;
                uint4 v = make_uint4(0u, 0u, 0u, 0u);
                if (row[m][i] != nullptr && k0 + kq < K_) v = q_row_run8_bf16(type[m], row[m][i], k0 + kq);
                *(uint4*)(sw + (m * GG_BN + n) * GP_LDW + kq) = v;
            }
    }
};

// grouped_gate_up_q and grouped_gemm_q, pipelined (same arguments and results), in tile shape S.
// Dynamic shared memory as the bf16 pipelined kernels. grid (n_tiles, ceil(N / GG_BN)), block
// GG_THREADS.
template <class S>
__device__ __forceinline__ void gate_up_q_pipe(const u8* G, const u8* U, int g_type, int u_type, int g_row_bytes,
                                               int u_row_bytes, const float* x, const int* rows, int n_x_rows,
                                               const int* tiles, int n_rows, int n_slots, float* h, int N, int K,
                                               int split, int act, const float* bg, const float* bu) {
    GpTyped<2> wl = {{G, U}, {g_type, u_type}, {g_row_bytes, u_row_bytes}, N, K};
    if (split)
        gp_gate_up<2, true, S>(wl, x, rows, n_x_rows, tiles, n_rows, n_slots, h, N, K, act, bg, bu);
    else
        gp_gate_up<1, true, S>(wl, x, rows, n_x_rows, tiles, n_rows, n_slots, h, N, K, act, bg, bu);
}
template <class S>
__device__ __forceinline__ void gemm_q_pipe(const u8* W, int w_type, int row_bytes, const float* x, const int* rows,
                                            int n_x_rows, const int* tiles, int n_rows, int n_slots, float* y, int N,
                                            int K, int split, const float* b) {
    GpTyped<1> wl = {{W}, {w_type}, {row_bytes}, N, K};
    if (split)
        gp_gemm<2, true, S>(wl, x, rows, n_x_rows, tiles, n_rows, n_slots, y, N, K, b);
    else
        gp_gemm<1, true, S>(wl, x, rows, n_x_rows, tiles, n_rows, n_slots, y, N, K, b);
}
#define GATE_UP_Q_PARAMS                                                                                       \
    const u8 *__restrict__ G, const u8 *__restrict__ U, int g_type, int u_type, int g_row_bytes, int u_row_bytes, \
        const float *__restrict__ x, const int *__restrict__ rows, int n_x_rows, const int *__restrict__ tiles,  \
        int n_rows, int n_slots, float *__restrict__ h, int N, int K, int split, int act,                        \
        const float *__restrict__ bg, const float *__restrict__ bu
#define GATE_UP_Q_ARGS G, U, g_type, u_type, g_row_bytes, u_row_bytes, x, rows, n_x_rows, tiles, n_rows, n_slots, h, N, K, split, act, bg, bu
#define GEMM_Q_PARAMS                                                                                          \
    const u8 *__restrict__ W, int w_type, int row_bytes, const float *__restrict__ x,                           \
        const int *__restrict__ rows, int n_x_rows, const int *__restrict__ tiles, int n_rows, int n_slots,      \
        float *__restrict__ y, int N, int K, int split, const float *__restrict__ b
#define GEMM_Q_ARGS W, w_type, row_bytes, x, rows, n_x_rows, tiles, n_rows, n_slots, y, N, K, split, b
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gate_up_q_pipe(GATE_UP_Q_PARAMS) {
    pdl_enter();
    gate_up_q_pipe<GpPrefill>(GATE_UP_Q_ARGS);
}
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gate_up_q_dec(GATE_UP_Q_PARAMS) {
    pdl_enter();
    gate_up_q_pipe<GpDecode>(GATE_UP_Q_ARGS);
}
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gemm_q_pipe(GEMM_Q_PARAMS) {
    pdl_enter();
    gemm_q_pipe<GpPrefill>(GEMM_Q_ARGS);
}
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gemm_q_dec(GEMM_Q_PARAMS) {
    pdl_enter();
    gemm_q_pipe<GpDecode>(GEMM_Q_ARGS);
}

// ---- the pipelined typed tiles, one instance per weight type: raw words fetched a stage ahead ----
// GpTyped decodes each run of 8 values as it loads it, so every stage waits for its global loads
// (ncu on the H100: L1 75% busy with the byte and half-word loads, 25% occupancy). Here a run's
// raw words are loaded into registers one stage ahead (the loads issue, nothing waits on them
// until the next stage's decode, a stage of MMAs later) with few wide loads, and decoded with the
// type known at compile time. Values and bf16 roundings are GpTyped's (the same operations), so
// the bits are too.

// Eight bytes at a 2-byte aligned address as the words that hold them, joined at decode (so the
// fetch itself waits for nothing).
struct Raw8 {
    unsigned a, b, c;
    bool odd;  // p % 4 == 2: a half-word, a word, a half-word
    __device__ __forceinline__ void fetch(const u8* p) {
        odd = (((size_t)p) & 3) != 0;
        if (odd) {
            a = *(const unsigned short*)p, b = *(const unsigned*)(p + 2), c = *(const unsigned short*)(p + 6);
        } else {
            a = ((const unsigned*)p)[0], b = ((const unsigned*)p)[1], c = 0u;
        }
    }
    __device__ __forceinline__ void words(unsigned& lo, unsigned& hi) const {
        lo = odd ? a | (b << 16) : a;
        hi = odd ? (b >> 16) | (c << 16) : b;
    }
};

// A run of 8 values of a row of type TY (kernel type codes, as q_row_run8_bf16): fetch(row, k)
// loads its raw words, decode(k) gives the eight bf16 (k a multiple of 8 inside the row).
template <int TY>
struct QRun;

// Q4_K (FIFTH false) and Q5_K: the block's 16 header bytes (d, dmin, 12 scale bytes) as one uint4,
// the 8 nibble bytes (and Q5_K's 8 fifth-bit bytes) as uint2; blocks 16-byte aligned (the loader's
// caller checks the cache and its rows).
template <bool FIFTH>
struct KRun {
    uint4 hd;
    uint2 q, h;
    __device__ __forceinline__ void fetch(const u8* row, int k) {
        const u8* b = row + (k >> 8) * (FIFTH ? Q5_K::BYTES : Q4_K::BYTES);
        int c = k & 255, p = c >> 6, l = c & 31;
        hd = *(const uint4*)b;
        q = *(const uint2*)(b + (FIFTH ? 48 : 16) + 32 * p + l);
        if (FIFTH) h = *(const uint2*)(b + 16 + l);
    }
    __device__ __forceinline__ uint4 decode(int k) const {
        int c = k & 255, j = c >> 5, sh = 4 * (j & 1);
        float d = __half2float(__ushort_as_half((unsigned short)(hd.x & 0xFFFFu)));
        float dmin = __half2float(__ushort_as_half((unsigned short)(hd.x >> 16)));
        // k_scale_min over the scale bytes p[0..11] = hd.y, hd.z, hd.w
        unsigned sc, m;
        if (j < 4) {
            sc = q_byte(hd.y, j) & 63, m = q_byte(hd.z, j) & 63;
        } else {
            int i = j - 4;
            sc = (q_byte(hd.w, i) & 15) | ((q_byte(hd.y, i) >> 6) << 4);
            m = (q_byte(hd.w, i) >> 4) | ((q_byte(hd.z, i) >> 6) << 4);
        }
        float s = __fmul_rn(d, (float)sc), n = __fmul_rn(dmin, (float)m);
        unsigned qw[2] = {q.x, q.y}, hw[2] = {FIFTH ? h.x : 0u, FIFTH ? h.y : 0u};
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            unsigned x = (q_byte(qw[i >> 2], i & 3) >> sh) & 15;
            x |= ((q_byte(hw[i >> 2], i & 3) >> j) & 1) << 4;
            v[i] = __fsub_rn(__fmul_rn(s, (float)x), n);
        }
        return q_bf16x8(v);
    }
};
template <>
struct QRun<2> : KRun<false> {};
template <>
struct QRun<3> : KRun<true> {};

// Q6_K (2-byte aligned blocks): d, the run's scale, 8 low-bit bytes and 8 high-bit bytes.
template <>
struct QRun<4> {
    unsigned short d;
    signed char sc;
    Raw8 ql, qh;
    __device__ __forceinline__ void fetch(const u8* row, int k) {
        const u8* b = row + (k >> 8) * Q6_K::BYTES;
        int c = k & 255, h = c >> 7, qr = (c >> 5) & 3, l = c & 31;
        d = *(const unsigned short*)(b + 208);
        sc = ((const signed char*)(b + 192))[8 * h + 2 * qr + (l >> 4)];
        ql.fetch(b + 64 * h + 32 * (qr & 1) + l);
        qh.fetch(b + 128 + 32 * h + l);
    }
    __device__ __forceinline__ uint4 decode(int k) const {
        int qr = (k >> 5) & 3, sh = qr < 2 ? 0 : 4;
        float s = __fmul_rn(__half2float(__ushort_as_half(d)), (float)sc);
        unsigned a[2], z[2];
        ql.words(a[0], a[1]);
        qh.words(z[0], z[1]);
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            unsigned lo = (q_byte(a[i >> 2], i & 3) >> sh) & 15, hb = (q_byte(z[i >> 2], i & 3) >> (2 * qr)) & 3;
            v[i] = __fmul_rn(s, (float)((int)(lo | (hb << 4)) - 32));
        }
        return q_bf16x8(v);
    }
};

// Q8_0 (2-byte aligned blocks): d and the run's 8 bytes.
template <>
struct QRun<0> {
    unsigned short d;
    Raw8 q;
    __device__ __forceinline__ void fetch(const u8* row, int k) {
        const u8* b = row + (k >> 5) * Q8_0::BYTES;
        d = *(const unsigned short*)b;
        q.fetch(b + 2 + (k & 31));
    }
    __device__ __forceinline__ uint4 decode(int) const {
        float s = __half2float(__ushort_as_half(d));
        unsigned w[2];
        q.words(w[0], w[1]);
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = __fmul_rn(s, (float)(signed char)q_byte(w[i >> 2], i & 3));
        return q_bf16x8(v);
    }
};

// MXFP4 (17-byte blocks at any address): the scale byte, and the run's 8 nibble bytes as the 2 or
// 3 aligned words that hold them, joined at decode by funnel shifts. The last word may reach up to
// 3 bytes past the run: the launcher takes this instance only for caches with that tail
// (`TYPED_TAIL_BYTES`). The values are QMX::run8's.
template <>
struct QRun<6> {
    unsigned a, b, c, sh;
    unsigned char e;
    __device__ __forceinline__ void fetch(const u8* row, int k) {
        const u8* blk = row + (k >> 5) * QMX::BYTES;
        size_t p = (size_t)(blk + 1 + (k & 15));
        const unsigned* w = (const unsigned*)(p & ~(size_t)3);
        e = blk[0];
        sh = 8 * (unsigned)(p & 3);
        a = w[0], b = w[1];
        c = sh != 0 ? w[2] : 0u;
    }
    __device__ __forceinline__ uint4 decode(int k) const {
        float d = mx_scale(e);
        int hs = (k & 31) < 16 ? 0 : 4;
        unsigned w0 = __funnelshift_r(a, b, sh), w1 = __funnelshift_r(b, c, sh);
        unsigned l0 = mx_levels4((w0 >> hs) & 0x0F0F0F0Fu), l1 = mx_levels4((w1 >> hs) & 0x0F0F0F0Fu);
        float v[8];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[i] = __fmul_rn((float)(signed char)q_byte(l0, i), d);
            v[4 + i] = __fmul_rn((float)(signed char)q_byte(l1, i), d);
        }
        return q_bf16x8(v);
    }
};

// gp_tile's loader over NW caches of one type TY: init finds this thread's rows and fetches the
// first stage's runs; each load decodes the runs fetched for that stage (gp_tile loads stages at
// consecutive k0) into the stage, then fetches the next stage's.
template <int NW, int TY>
struct GpRun {
    const u8* W[NW];
    int row_bytes[NW];
    int N, K;
    const u8* row[NW][GP_W_CHUNKS];
    QRun<TY> raw[NW][GP_W_CHUNKS];
    __device__ __forceinline__ bool live(int m, int i, int k0) const {
        int kq = ((threadIdx.x + i * GG_THREADS) % (GP_BK / 8)) * 8;
        return row[m][i] != nullptr && k0 + kq < K;
    }
    __device__ __forceinline__ void fetch(int k0) {
#pragma unroll
        for (int m = 0; m < NW; m++)
#pragma unroll
            for (int i = 0; i < GP_W_CHUNKS; i++) {
                int kq = ((threadIdx.x + i * GG_THREADS) % (GP_BK / 8)) * 8;
                if (live(m, i, k0)) raw[m][i].fetch(row[m][i], k0 + kq);
            }
    }
    __device__ __forceinline__ void init(int slot, int col0) {
#pragma unroll
        for (int m = 0; m < NW; m++)
#pragma unroll
            for (int i = 0; i < GP_W_CHUNKS; i++) {
                int n = (threadIdx.x + i * GG_THREADS) / (GP_BK / 8);
                row[m][i] = col0 + n < N ? W[m] + ((size_t)slot * N + col0 + n) * row_bytes[m] : nullptr;
            }
        fetch(0);
    }
    __device__ __forceinline__ void load(bf16* sw, int, int k0) {
#pragma unroll
        for (int m = 0; m < NW; m++)
#pragma unroll
            for (int i = 0; i < GP_W_CHUNKS; i++) {
                int c = threadIdx.x + i * GG_THREADS, n = c / (GP_BK / 8), kq = (c % (GP_BK / 8)) * 8;
                uint4 v = live(m, i, k0) ? raw[m][i].decode(k0 + kq) : make_uint4(0u, 0u, 0u, 0u);
                *(uint4*)(sw + (m * GG_BN + n) * GP_LDW + kq) = v;
            }
        if (k0 + GP_BK < K) fetch(k0 + GP_BK);
    }
};

// grouped_gate_up_q_pipe and grouped_gemm_q_pipe for gate and up (or the one matrix) of type TY,
// in tile shape S: the same arguments (the type codes are the instance's) and the same bits.
template <int TY, class S>
__device__ __forceinline__ void gate_up_run(const u8* G, const u8* U, int g_row_bytes, int u_row_bytes,
                                            const float* x, const int* rows, int n_x_rows, const int* tiles,
                                            int n_rows, int n_slots, float* h, int N, int K, int split, int act,
                                            const float* bg, const float* bu) {
    GpRun<2, TY> wl = {{G, U}, {g_row_bytes, u_row_bytes}, N, K};
    if (split)
        gp_gate_up<2, true, S>(wl, x, rows, n_x_rows, tiles, n_rows, n_slots, h, N, K, act, bg, bu);
    else
        gp_gate_up<1, true, S>(wl, x, rows, n_x_rows, tiles, n_rows, n_slots, h, N, K, act, bg, bu);
}
template <int TY, class S>
__device__ __forceinline__ void gemm_run(const u8* W, int row_bytes, const float* x, const int* rows, int n_x_rows,
                                         const int* tiles, int n_rows, int n_slots, float* y, int N, int K,
                                         int split, const float* b) {
    GpRun<1, TY> wl = {{W}, {row_bytes}, N, K};
    if (split)
        gp_gemm<2, true, S>(wl, x, rows, n_x_rows, tiles, n_rows, n_slots, y, N, K, b);
    else
        gp_gemm<1, true, S>(wl, x, rows, n_x_rows, tiles, n_rows, n_slots, y, N, K, b);
}
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gate_up_q8_0_pipe(GATE_UP_Q_PARAMS) {
    pdl_enter();
    gate_up_run<0, GpPrefill>(G, U, g_row_bytes, u_row_bytes, x, rows, n_x_rows, tiles, n_rows, n_slots, h, N, K, split, act, bg, bu);
}
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gate_up_q4_k_pipe(GATE_UP_Q_PARAMS) {
    pdl_enter();
    gate_up_run<2, GpPrefill>(G, U, g_row_bytes, u_row_bytes, x, rows, n_x_rows, tiles, n_rows, n_slots, h, N, K, split, act, bg, bu);
}
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gate_up_q5_k_pipe(GATE_UP_Q_PARAMS) {
    pdl_enter();
    gate_up_run<3, GpPrefill>(G, U, g_row_bytes, u_row_bytes, x, rows, n_x_rows, tiles, n_rows, n_slots, h, N, K, split, act, bg, bu);
}
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gate_up_q6_k_pipe(GATE_UP_Q_PARAMS) {
    pdl_enter();
    gate_up_run<4, GpPrefill>(G, U, g_row_bytes, u_row_bytes, x, rows, n_x_rows, tiles, n_rows, n_slots, h, N, K, split, act, bg, bu);
}
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gemm_q8_0_pipe(GEMM_Q_PARAMS) {
    pdl_enter();
    gemm_run<0, GpPrefill>(W, row_bytes, x, rows, n_x_rows, tiles, n_rows, n_slots, y, N, K, split, b);
}
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gemm_q4_k_pipe(GEMM_Q_PARAMS) {
    pdl_enter();
    gemm_run<2, GpPrefill>(W, row_bytes, x, rows, n_x_rows, tiles, n_rows, n_slots, y, N, K, split, b);
}
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gemm_q5_k_pipe(GEMM_Q_PARAMS) {
    pdl_enter();
    gemm_run<3, GpPrefill>(W, row_bytes, x, rows, n_x_rows, tiles, n_rows, n_slots, y, N, K, split, b);
}
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gemm_q6_k_pipe(GEMM_Q_PARAMS) {
    pdl_enter();
    gemm_run<4, GpPrefill>(W, row_bytes, x, rows, n_x_rows, tiles, n_rows, n_slots, y, N, K, split, b);
}
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gate_up_q8_0_dec(GATE_UP_Q_PARAMS) {
    pdl_enter();
    gate_up_run<0, GpDecode>(G, U, g_row_bytes, u_row_bytes, x, rows, n_x_rows, tiles, n_rows, n_slots, h, N, K, split, act, bg, bu);
}
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gate_up_q4_k_dec(GATE_UP_Q_PARAMS) {
    pdl_enter();
    gate_up_run<2, GpDecode>(G, U, g_row_bytes, u_row_bytes, x, rows, n_x_rows, tiles, n_rows, n_slots, h, N, K, split, act, bg, bu);
}
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gate_up_q5_k_dec(GATE_UP_Q_PARAMS) {
    pdl_enter();
    gate_up_run<3, GpDecode>(G, U, g_row_bytes, u_row_bytes, x, rows, n_x_rows, tiles, n_rows, n_slots, h, N, K, split, act, bg, bu);
}
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gate_up_q6_k_dec(GATE_UP_Q_PARAMS) {
    pdl_enter();
    gate_up_run<4, GpDecode>(G, U, g_row_bytes, u_row_bytes, x, rows, n_x_rows, tiles, n_rows, n_slots, h, N, K, split, act, bg, bu);
}
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gemm_q8_0_dec(GEMM_Q_PARAMS) {
    pdl_enter();
    gemm_run<0, GpDecode>(W, row_bytes, x, rows, n_x_rows, tiles, n_rows, n_slots, y, N, K, split, b);
}
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gemm_q4_k_dec(GEMM_Q_PARAMS) {
    pdl_enter();
    gemm_run<2, GpDecode>(W, row_bytes, x, rows, n_x_rows, tiles, n_rows, n_slots, y, N, K, split, b);
}
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gemm_q5_k_dec(GEMM_Q_PARAMS) {
    pdl_enter();
    gemm_run<3, GpDecode>(W, row_bytes, x, rows, n_x_rows, tiles, n_rows, n_slots, y, N, K, split, b);
}
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gemm_q6_k_dec(GEMM_Q_PARAMS) {
    pdl_enter();
    gemm_run<4, GpDecode>(W, row_bytes, x, rows, n_x_rows, tiles, n_rows, n_slots, y, N, K, split, b);
}
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gate_up_mxfp4_pipe(GATE_UP_Q_PARAMS) {
    pdl_enter();
    gate_up_run<6, GpPrefill>(G, U, g_row_bytes, u_row_bytes, x, rows, n_x_rows, tiles, n_rows, n_slots, h, N, K, split, act, bg, bu);
}
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gate_up_mxfp4_dec(GATE_UP_Q_PARAMS) {
    pdl_enter();
    gate_up_run<6, GpDecode>(G, U, g_row_bytes, u_row_bytes, x, rows, n_x_rows, tiles, n_rows, n_slots, h, N, K, split, act, bg, bu);
}
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gemm_mxfp4_pipe(GEMM_Q_PARAMS) {
    pdl_enter();
    gemm_run<6, GpPrefill>(W, row_bytes, x, rows, n_x_rows, tiles, n_rows, n_slots, y, N, K, split, b);
}
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gemm_mxfp4_dec(GEMM_Q_PARAMS) {
    pdl_enter();
    gemm_run<6, GpDecode>(W, row_bytes, x, rows, n_x_rows, tiles, n_rows, n_slots, y, N, K, split, b);
}

// ---- int8 tiles over 8-bit activations (as llama.cpp's MMQ): MXFP4 caches ----
// x is quantised per row and block of 32 by quantize_q8_f32 (xq int8 [n_x_rows, K], xd f32
// [n_x_rows, K / 32], the GEMV's Q8Rows); each weight block of 32 becomes its int8 levels (MXFP4:
// the doubled E2M1 values, exact in int8) and one f32 scale (half the E8M0 value). mma.sync
// m16n8k32 over int8 gives one block's integer dot per accumulator, which dx * dw scales into the
// f32 sums, block by block: the GEMV's q8 path's value of each block, summed in k order. A stage
// holds GQ_BK columns: x levels [BM][GQ_LD] int8, x scales [BM][GQ_KB], then per matrix the weight
// levels [GG_BN][GQ_LD] and scales [GG_BN][GQ_KB]; the weight words are fetched a stage ahead into
// registers (as GpRun) and the x rows copied by cp.async, GG_STAGES - 1 stages ahead.
#define GQ_KB (GQ_BK / 32)
#define GQ_LD (GQ_BK + 16)  // int8 row stride: 80 bytes, as GP_LDW's bf16 (ldmatrix's rows in distinct banks)

#if GQ_LD != 2 * GP_LDW || GQ_BK % 32 != 0
#error "the int8 stages reuse gp_frag_b's stride (GQ_LD bytes must be GP_LDW bf16) and hold whole blocks"
#endif

// 4 bytes from global to shared without waiting (cp.async, sm_80+; a plain copy before).
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
#if __CUDA_ARCH__ >= 800
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 4 : 0));
#else
    *(unsigned*)dst = valid ? *(const unsigned*)src : 0u;
#endif
}

// d = a . b over int8 (mma.sync m16n8k32, s32; sm_80 and later; before, dp4a over the shuffled
// fragments). a: row g = lane / 4, a[0] k 4t..4t+3, a[1] row g + 8, a[2] k + 16, a[3] both
// (t = lane % 4); b0, b1: column g, k 4t.. and 16 + 4t..; d[0..1] row g, columns 2t, 2t + 1,
// d[2..3] row g + 8.
__device__ __forceinline__ void mma_s8_16832(int* d, const unsigned* a, unsigned b0, unsigned b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%10,%10,%10};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0));
#else
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    for (int c = 0; c < 4; c++) {
        int row = g + (c >= 2 ? 8 : 0), col = t * 2 + (c & 1), s = 0;
        for (int kk = 0; kk < 8; kk++) {
            unsigned aw = __shfl_sync(0xffffffffu, a[((kk >> 2) << 1) | (row >> 3)], ((row & 7) << 2) | (kk & 3));
            unsigned bw = __shfl_sync(0xffffffffu, kk < 4 ? b0 : b1, (col << 2) | (kk & 3));
            s = __dp4a((int)aw, (int)bw, s);
        }
        d[c] = s;
    }
#endif
}

// The A fragment of m16n8k32 (rows rb..rb+15, int8 columns 32 kb..32 kb + 31 of an x stage of
// GQ_LD-byte rows): gg_frag_a's ldmatrix over the int8 pairs as b16.
__device__ __forceinline__ void gq_frag_a(unsigned* a, const signed char* sq, int rb, int kb) {
    int lane = threadIdx.x & 31;
    const signed char* p = sq + (rb + (lane & 15)) * GQ_LD + 32 * kb + 16 * (lane >> 4);
#if __CUDA_ARCH__ >= 750
    unsigned addr = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
                 : "r"(addr));
#else
    int g = lane >> 2, t = lane & 3;
    const signed char* q = sq + (rb + g) * GQ_LD + 32 * kb + 4 * t;
    a[0] = *(const unsigned*)q, a[1] = *(const unsigned*)(q + 8 * GQ_LD);
    a[2] = *(const unsigned*)(q + 16), a[3] = *(const unsigned*)(q + 8 * GQ_LD + 16);
#endif
}

// The byte offsets of a stage's parts for tile shape S and NW weight matrices.
template <class S, int NW>
struct GqStage {
    static constexpr int XD = S::BM * GQ_LD;             // x scales
    static constexpr int W = XD + S::BM * GQ_KB * 4;     // weight levels
    static constexpr int WD = W + NW * GG_BN * GQ_LD;    // weight scales
    static constexpr int BYTES = WD + NW * GG_BN * GQ_KB * 4;
    static_assert(XD % 16 == 0 && W % 16 == 0 && WD % 16 == 0 && BYTES % 16 == 0, "16-byte aligned parts");
};

// The x rows of this thread's copies: 16-byte chunks of levels (GQ_BK / 16 a row) and the rows'
// scales (one 4-byte copy per row and block); the tile's row r is token rows[row0 + r].
template <class S>
struct GqX {
    static constexpr int CHUNKS = S::BM * (GQ_BK / 16) / GG_THREADS;
    static_assert(CHUNKS >= 1 && CHUNKS * GG_THREADS == S::BM * (GQ_BK / 16), "chunks cover the stage");
    const signed char* q[CHUNKS];
    const float* d;  // this thread's scale row (threads < BM * GQ_KB), null when none
    const signed char* any;
    __device__ __forceinline__ const signed char* row_of(const signed char* xq, const int* rows, int n_x_rows,
                                                         int row0, int nr, int r, int K) const {
        int src = r < nr ? (rows ? rows[row0 + r] : row0 + r) : -1;
        return src >= 0 && src < n_x_rows ? xq + (size_t)src * K : nullptr;
    }
    __device__ __forceinline__ void init(const signed char* xq, const float* xd, const int* rows, int n_x_rows,
                                         int row0, int nr, int K) {
        any = xq;
#pragma unroll
        for (int i = 0; i < CHUNKS; i++) {
            int r = (threadIdx.x + i * GG_THREADS) / (GQ_BK / 16);
            q[i] = row_of(xq, rows, n_x_rows, row0, nr, r, K);
        }
        int r = threadIdx.x / GQ_KB;
        const signed char* row = threadIdx.x < S::BM * GQ_KB ? row_of(xq, rows, n_x_rows, row0, nr, r, K) : nullptr;
        d = row ? xd + (row - xq) / 32 : nullptr;
    }
    // Queue the copies of k step k0 (levels and scales past K are zeros).
    __device__ __forceinline__ void load(unsigned char* stage, const float* xd, int K, int k0) const {
#pragma unroll
        for (int i = 0; i < CHUNKS; i++) {
            int c = threadIdx.x + i * GG_THREADS, r = c / (GQ_BK / 16), kq = (c % (GQ_BK / 16)) * 16;
            bool ok = q[i] != nullptr && k0 + kq < K;
            cp_async16(stage + r * GQ_LD + kq, ok ? (const void*)(q[i] + k0 + kq) : (const void*)any, ok);
        }
        if (threadIdx.x < S::BM * GQ_KB) {
            int r = threadIdx.x / GQ_KB, kb = threadIdx.x % GQ_KB;
            bool ok = d != nullptr && k0 + 32 * kb < K;
            float* dst = (float*)(stage + GqStage<S, 1>::XD) + r * GQ_KB + kb;
            cp_async4(dst, ok ? (const void*)(d + k0 / 32 + kb) : (const void*)xd, ok);
        }
    }
};

// One MXFP4 block's raw bytes: the scale and the 5 aligned words around its 16 nibble bytes
// (the last may reach 3 bytes past the block: the caches carry TYPED_TAIL_BYTES).
struct MxRaw {
    unsigned v[5], sh;
    unsigned char e;
    __device__ __forceinline__ void fetch(const u8* blk) {
        size_t p = (size_t)(blk + 1);
        const unsigned* w = (const unsigned*)(p & ~(size_t)3);
        sh = 8 * (unsigned)(p & 3);
        e = blk[0];
#pragma unroll
        for (int k = 0; k < 5; k++) v[k] = w[k];
    }
    // The 32 levels (values 0..15 in lo, 16..31 in hi, 4 a word) and the scale.
    __device__ __forceinline__ float decode(uint4& lo, uint4& hi) const {
        unsigned l[4], h[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            unsigned w = __funnelshift_r(v[k], v[k + 1], sh);
            l[k] = mx_levels4(w & 0x0F0F0F0Fu), h[k] = mx_levels4((w >> 4) & 0x0F0F0F0Fu);
        }
        lo = make_uint4(l[0], l[1], l[2], l[3]), hi = make_uint4(h[0], h[1], h[2], h[3]);
        return mx_scale(e);
    }
};

// The weight loader over NW MXFP4 caches [n_slots, N, K]: thread c of a matrix owns column
// c / GQ_KB's block c % GQ_KB of each stage (GG_BN * GQ_KB = GG_THREADS blocks a matrix); its raw
// bytes are fetched a stage ahead, decoded into the stage at load.
template <int NW>
struct GqMx {
    const u8* W[NW];
    int row_bytes[NW];
    int N, K;
    const u8* row[NW];
    MxRaw raw[NW];
    __device__ __forceinline__ bool live(int m, int k0) const {
        return row[m] != nullptr && k0 + 32 * (threadIdx.x % GQ_KB) < K;
    }
    __device__ __forceinline__ void fetch(int k0) {
#pragma unroll
        for (int m = 0; m < NW; m++)
            if (live(m, k0)) raw[m].fetch(row[m] + (k0 / 32 + threadIdx.x % GQ_KB) * QMX::BYTES);
    }
    __device__ __forceinline__ void init(int slot, int col0) {
        int n = threadIdx.x / GQ_KB;
#pragma unroll
        for (int m = 0; m < NW; m++)
            row[m] = col0 + n < N ? W[m] + ((size_t)slot * N + col0 + n) * row_bytes[m] : nullptr;
        fetch(0);
    }
    template <class S>
    __device__ __forceinline__ void load(unsigned char* stage, int k0) {
        int n = threadIdx.x / GQ_KB, kb = threadIdx.x % GQ_KB;
#pragma unroll
        for (int m = 0; m < NW; m++) {
            uint4 lo = make_uint4(0u, 0u, 0u, 0u), hi = lo;
            float d = live(m, k0) ? raw[m].decode(lo, hi) : 0.f;
            signed char* sw = (signed char*)(stage + GqStage<S, NW>::W) + (m * GG_BN + n) * GQ_LD + 32 * kb;
            *(uint4*)sw = lo;
            *(uint4*)(sw + 16) = hi;
            ((float*)(stage + GqStage<S, NW>::WD))[(m * GG_BN + n) * GQ_KB + kb] = d;
        }
        if (k0 + GQ_BK < K) fetch(k0 + GQ_BK);
    }
};

// The MMAs of one stage (k columns k0..k0+GQ_BK, `kvalid` of them before K) for warp w: every
// row group of the tile against columns w * 16..w * 16 + 15 (gp_multiply's layout), each
// block's integer dots scaled by its x and weight scales into acc.
template <int NW, class S>
__device__ __forceinline__ void gq_multiply(const unsigned char* stage, int kvalid, int nr, int col0, int N,
                                            float acc[NW][S::MI][2][4]) {
    typedef GqStage<S, NW> L;
    const signed char* sq = (const signed char*)stage;
    const float* xd = (const float*)(stage + L::XD);
    const float* wd = (const float*)(stage + L::WD);
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, wn = threadIdx.x >> 5;
#pragma unroll
    for (int kb = 0; kb < GQ_KB; kb++) {
        if (32 * kb >= kvalid) break;
        unsigned b[NW][4];
        float ws[NW][2][2];
#pragma unroll
        for (int m = 0; m < NW; m++) {
            gp_frag_b(b[m], (const bf16*)(stage + L::W) + m * GG_BN * GP_LDW, wn * 16, 16 * kb);
#pragma unroll
            for (int ni = 0; ni < 2; ni++)
#pragma unroll
                for (int j = 0; j < 2; j++) ws[m][ni][j] = wd[(m * GG_BN + wn * 16 + ni * 8 + 2 * t + j) * GQ_KB + kb];
        }
#pragma unroll
        for (int mi = 0; mi < S::MI; mi++) {
            if (mi * 16 >= nr) break;
            unsigned a[4];
            gq_frag_a(a, sq, mi * 16, kb);
            float x0 = xd[(mi * 16 + g) * GQ_KB + kb], x1 = xd[(mi * 16 + g + 8) * GQ_KB + kb];
#pragma unroll
            for (int m = 0; m < NW; m++)
#pragma unroll
                for (int ni = 0; ni < 2; ni++) {
                    if (col0 + wn * 16 + ni * 8 >= N) continue;
                    int d[4];
                    mma_s8_16832(d, a, b[m][2 * ni], b[m][2 * ni + 1]);
                    float* c = acc[m][mi][ni];
                    c[0] = fmaf((float)d[0], x0 * ws[m][ni][0], c[0]);
                    c[1] = fmaf((float)d[1], x0 * ws[m][ni][1], c[1]);
                    c[2] = fmaf((float)d[2], x1 * ws[m][ni][0], c[2]);
                    c[3] = fmaf((float)d[3], x1 * ws[m][ni][1], c[3]);
                }
        }
    }
}

// gp_tile over int8 stages: the same tiles, refusals and output layout; x as Q8Rows (xq, xd).
template <int NW, class S>
__device__ __forceinline__ bool gq_tile(GqMx<NW>& wl, const signed char* __restrict__ xq, const float* __restrict__ xd,
                                        const int* __restrict__ rows, int n_x_rows, const int* __restrict__ tiles,
                                        int n_rows, int n_slots, int N, int K, float acc[NW][S::MI][2][4],
                                        int* tile_out) {
    extern __shared__ __align__(16) unsigned char gq_smem[];
    typedef GqStage<S, NW> L;
    const int* tl = tiles + 3 * (size_t)blockIdx.x;
    int slot = tl[0], row0 = tl[1], nr = tl[2], col0 = blockIdx.y * GG_BN;
    if (slot < 0 || slot >= n_slots || row0 < 0 || nr <= 0 || nr > S::BM || row0 > n_rows - nr) return false;
    tile_out[0] = row0, tile_out[1] = nr, tile_out[2] = col0, tile_out[3] = slot;
#pragma unroll
    for (int m = 0; m < NW; m++)
#pragma unroll
        for (int mi = 0; mi < S::MI; mi++)
#pragma unroll
            for (int ni = 0; ni < 2; ni++)
#pragma unroll
                for (int c = 0; c < 4; c++) acc[m][mi][ni][c] = 0.f;
    GqX<S> xs;
    xs.init(xq, xd, rows, n_x_rows, row0, nr, K);
    wl.init(slot, col0);
    int n_k = (K + GQ_BK - 1) / GQ_BK;
    // x copies run STAGES - 1 stages ahead; the weights are decoded into a stage just before it
    // is multiplied (their raw words were fetched a stage earlier)
#pragma unroll
    for (int s = 0; s < S::STAGES - 1; s++) {
        if (s < n_k) xs.load(gq_smem + s * L::BYTES, xd, K, s * GQ_BK);
        gp_commit();
    }
    for (int kt = 0; kt < n_k; kt++) {
        unsigned char* stage = gq_smem + (kt % S::STAGES) * L::BYTES;
        wl.template load<S>(stage, kt * GQ_BK);
        gp_wait<S>();
        __syncthreads();  // stage kt's x landed and its weights are written; stage kt - 1 is free
        int next = kt + S::STAGES - 1;
        if (next < n_k) xs.load(gq_smem + (next % S::STAGES) * L::BYTES, xd, K, next * GQ_BK);
        gp_commit();
        gq_multiply<NW, S>(stage, K - kt * GQ_BK, nr, col0, N, acc);
    }
    return true;
}

// grouped_gate_up_mxfp4_pipe over 8-bit x (xq, xd: Q8Rows of x's rows): h[r, :] = glu(act,
// G_s . x_r + bg[s], U_s . x_r + bu[s]); grid (n_tiles, ceil(N / GG_BN)), GG_THREADS, dynamic
// shared memory GG_STAGES int8 stages (GqStage).
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gate_up_mxfp4_q8(
    const u8* __restrict__ G, const u8* __restrict__ U, int g_row_bytes, int u_row_bytes,
    const signed char* __restrict__ xq, const float* __restrict__ xd, const int* __restrict__ rows, int n_x_rows,
    const int* __restrict__ tiles, int n_rows, int n_slots, float* __restrict__ h, int N, int K, int act,
    const float* __restrict__ bg, const float* __restrict__ bu) {
    pdl_enter();
    GqMx<2> wl = {{G, U}, {g_row_bytes, u_row_bytes}, N, K};
    float acc[2][GpPrefill::MI][2][4];
    int tile[4];
    if (!gq_tile<2, GpPrefill>(wl, xq, xd, rows, n_x_rows, tiles, n_rows, n_slots, N, K, acc, tile)) return;
    int row0 = tile[0], nr = tile[1], col0 = tile[2], slot = tile[3];
    gp_for_output<GpPrefill>(nr, N, col0, [&](int row, int col, int mi, int ni, int c) {
        h[(size_t)(row0 + row) * N + col] = glu_biased(act, acc[0][mi][ni][c], acc[1][mi][ni][c], bg, bu, slot, col, N);
    });
}

// grouped_gemm_mxfp4_pipe over 8-bit x: y[r, :] = W_s . x_r + b[s] (b null: none).
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gemm_mxfp4_q8(
    const u8* __restrict__ W, int row_bytes, const signed char* __restrict__ xq, const float* __restrict__ xd,
    const int* __restrict__ rows, int n_x_rows, const int* __restrict__ tiles, int n_rows, int n_slots,
    float* __restrict__ y, int N, int K, const float* __restrict__ b) {
    pdl_enter();
    GqMx<1> wl = {{W}, {row_bytes}, N, K};
    float acc[1][GpPrefill::MI][2][4];
    int tile[4];
    if (!gq_tile<1, GpPrefill>(wl, xq, xd, rows, n_x_rows, tiles, n_rows, n_slots, N, K, acc, tile)) return;
    int row0 = tile[0], nr = tile[1], col0 = tile[2], slot = tile[3];
    gp_for_output<GpPrefill>(nr, N, col0, [&](int row, int col, int mi, int ni, int c) {
        y[(size_t)(row0 + row) * N + col] = acc[0][mi][ni][c] + (b ? b[(size_t)slot * N + col] : 0.f);
    });
}
