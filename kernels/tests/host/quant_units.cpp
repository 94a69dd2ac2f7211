// Host harness for the block decoding of kernels/cuda/quant.cu: kernels/tests/quant_cu_host.rs
// puts the section between the "block decoding" markers of quant.cu at @QUANT_DECODE@, compiles
// it with the host C++ compiler (these shims stand in for the CUDA intrinsics; -ffp-contract=off
// keeps products and differences unfused as __fmul_rn/__fsub_rn do) and runs it on the gguf-py
// fixtures: every unit (and every wide chunk) of every block must decode to gguf-py's value bit for
// bit, and the units (chunks) of a block must cover each of its columns exactly once. Usage: quant_units FIXTURE_DIR

#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cmath>
#include <vector>
#include <fstream>
#include <iterator>
#define __device__
#define __forceinline__ inline
struct Half { uint16_t bits; };
static inline Half __ushort_as_half(unsigned short b) { return Half{b}; }
static inline float __half2float(Half h) {
    uint32_t s = (h.bits >> 15) & 1, e = (h.bits >> 10) & 31, m = h.bits & 1023;
    float v = e == 0 ? std::ldexp((float)m, -24) : e == 31 ? (m ? NAN : INFINITY) : std::ldexp((float)(m | 1024), (int)e - 25);
    return s ? -v : v;
}
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
struct uint4 { unsigned x, y, z, w; };
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
static inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned sh) {
    return (unsigned)((((uint64_t)hi << 32) | lo) >> (sh & 31));
}
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
// CUDA's byte permute: result byte i is byte (selector nibble i & 7) of {y, x}; nibble bit 3
// replicates that byte's sign bit.
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    uint64_t v = ((uint64_t)y << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; i++) {
        unsigned n = (s >> (4 * i)) & 15, b = (unsigned)(v >> (8 * (n & 7))) & 255;
        if (n & 8) b = (b & 128) ? 255 : 0;
        r |= b << (8 * i);
    }
    return r;
}
// @QUANT_DECODE@
static std::vector<char> slurp(const char* p) { std::ifstream f(p, std::ios::binary); return std::vector<char>(std::istreambuf_iterator<char>(f), {}); }
// A type's fixture: its blocks and gguf-py's values for them.
static void load(const char* dir, const char* name, std::vector<char>& blocks, std::vector<char>& deq) {
    char pb[256], pd[256];
    snprintf(pb, 256, "%s/%s.blocks", dir, name);
    snprintf(pd, 256, "%s/%s.dequant.f32", dir, name);
    blocks = slurp(pb), deq = slurp(pd);
}
template <class Q> int check(const char* dir, const char* name) {
    std::vector<char> blocks, deq;
    load(dir, name, blocks, deq);
    size_t nb = blocks.size() / Q::BYTES; const float* want = (const float*)deq.data();
    if (nb == 0 || deq.size() != nb * Q::ELEMS * 4) { printf("%s: size mismatch\n", name); return 1; }
    // copy each block to a 4-aligned buffer (the kernels' alignment)
    alignas(16) u8 buf[256];
    int bad = 0;
    for (size_t b = 0; b < nb; b++) {
        std::vector<int> seen(Q::ELEMS, 0);
        for (int i = 0; i < Q::BYTES; i++) buf[i] = (u8)blocks[b * Q::BYTES + i];
        for (int u = 0; u < Q::LANES; u++) {
            float v[8]; int c0, c1;
            Q::unit(buf, u, v, c0, c1);
            for (int i = 0; i < 8; i++) {
                int c = (i < 4 ? c0 : c1) + (i & 3);
                seen[c]++;
                float w = want[b * Q::ELEMS + c];
                if (memcmp(&w, &v[i], 4) != 0 && bad++ < 5) printf("%s block %zu col %d: %g vs %g\n", name, b, c, v[i], w);
            }
        }
        for (int c = 0; c < Q::ELEMS; c++) if (seen[c] != 1 && bad++ < 5) printf("%s block %zu col %d covered %d times\n", name, b, c, seen[c]);
    }
    printf("%s: %zu blocks, %d mismatches\n", name, nb, bad);
    return bad != 0;
}
// Block offsets from a 16-byte aligned address a check takes: 0, and 2 for the types stored
// 2-byte aligned (odd), every offset 0..3 for MXFP4's 17-byte blocks (any).
static bool take_shift(int shift, bool odd, bool any) { return shift == 0 || any || (odd && shift == 2); }
// The wide chunks (W::chunk, 32 values each) against the same fixtures, with the block at a
// 16-byte aligned address and, for the types stored 2-byte aligned, at 2 mod 4 as well.
template <class W> int check_wide(const char* dir, const char* name, bool odd, bool any = false) {
    std::vector<char> blocks, deq;
    load(dir, name, blocks, deq);
    size_t nb = blocks.size() / W::BYTES; const float* want = (const float*)deq.data();
    alignas(16) u8 buf[512];
    int bad = 0;
    for (int shift : {0, 1, 2, 3}) {
        if (!take_shift(shift, odd, any)) continue;
        for (size_t b = 0; b < nb; b++) {
            std::vector<int> seen(W::ELEMS, 0);
            u8* blk = buf + shift;
            for (int i = 0; i < W::BYTES; i++) blk[i] = (u8)blocks[b * W::BYTES + i];
            for (int i = W::BYTES; i < W::BYTES + 16; i++) blk[i] = 0xA5;  // the next block's bytes
            for (int j = 0; j < W::CHUNKS; j++) {
                float v[32]; int c[4];
                W::cols(j, c);
                W::chunk(blk, j, v);
                for (int i = 0; i < 32; i++) {
                    int col = c[i >> 3] + (i & 7);
                    seen[col]++;
                    float w = want[b * W::ELEMS + col];
                    if (memcmp(&w, &v[i], 4) != 0 && bad++ < 5) printf("%s wide block %zu col %d: %g vs %g\n", name, b, col, v[i], w);
                }
            }
            for (int c = 0; c < W::ELEMS; c++) if (seen[c] != 1 && bad++ < 5) printf("%s wide block %zu col %d covered %d times\n", name, b, c, seen[c]);
        }
    }
    printf("%s wide: %zu blocks, %d mismatches\n", name, nb, bad);
    return bad != 0;
}
// The runs of 8 consecutive values (Q::run8, the grouped prefill GEMM's weight tiles) against the
// same fixtures, blocks at a 16-byte aligned address and, for the 2-byte aligned types, at 2 mod 4.
template <class Q> int check_run8(const char* dir, const char* name, bool odd, bool any = false) {
    std::vector<char> blocks, deq;
    load(dir, name, blocks, deq);
    size_t nb = blocks.size() / Q::BYTES; const float* want = (const float*)deq.data();
    alignas(16) u8 buf[512];
    int bad = 0;
    for (int shift : {0, 1, 2, 3}) {
        if (!take_shift(shift, odd, any)) continue;
        for (size_t b = 0; b < nb; b++) {
            u8* blk = buf + shift;
            for (int i = 0; i < Q::BYTES; i++) blk[i] = (u8)blocks[b * Q::BYTES + i];
            for (int c = 0; c < Q::ELEMS; c += 8) {
                float v[8];
                Q::run8(blk, c, v);
                for (int i = 0; i < 8; i++) {
                    float w = want[b * Q::ELEMS + c + i];
                    if (memcmp(&w, &v[i], 4) != 0 && bad++ < 5) printf("%s run8 block %zu col %d: %g vs %g\n", name, b, c + i, v[i], w);
                }
            }
        }
    }
    printf("%s run8: %zu blocks, %d mismatches\n", name, nb, bad);
    return bad != 0;
}
int main(int argc, char** argv) {
    if (argc != 2) return 2;
    const char* d = argv[1];
    int f = check<Q8_0>(d, "q8_0") + check<Q4_0>(d, "q4_0") + check<Q4_K>(d, "q4_k") + check<Q5_K>(d, "q5_k") +
            check<Q6_K>(d, "q6_k") + check<QMX>(d, "mxfp4") + check<Q5_0>(d, "q5_0") + check<Q5_1>(d, "q5_1") +
            check<QNL>(d, "iq4_nl");
    f += check_wide<W8_0>(d, "q8_0", true) + check_wide<W4_0>(d, "q4_0", true) + check_wide<W4_K>(d, "q4_k", false) +
         check_wide<W5_K>(d, "q5_k", false) + check_wide<W6_K>(d, "q6_k", true) + check_wide<WMX>(d, "mxfp4", true, true);
    f += check_wide<W5_0>(d, "q5_0", true) + check_wide<W5_1>(d, "q5_1", true) + check_wide<WNL>(d, "iq4_nl", true);
    f += check_run8<Q8_0>(d, "q8_0", true) + check_run8<Q4_0>(d, "q4_0", true) + check_run8<Q4_K>(d, "q4_k", false) +
         check_run8<Q5_K>(d, "q5_k", false) + check_run8<Q6_K>(d, "q6_k", true) + check_run8<QMX>(d, "mxfp4", true, true);
    f += check_run8<Q5_0>(d, "q5_0", true) + check_run8<Q5_1>(d, "q5_1", true) + check_run8<QNL>(d, "iq4_nl", true);
    return f;
}
