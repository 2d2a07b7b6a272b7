/* mxdelay's codec kernels: the float32 operations of kvstore_ext.quantize (pushes 'int8',
 * 'int4', 'ternary'), kvstore_ext.pull_codecs (pulls 'fp16', 'int8') and the float16 casts,
 * fused into one or two passes over memory. Every function computes the bits the numpy code
 * computes (but for which NaN a NaN is); kvstore_ext/codecs/kernels/__init__.py documents
 * them and tests/test_codec_kernels.py checks them.
 *
 * Built without -ffast-math and with -ffp-contract=off: no reassociation and no fused
 * multiply-add (`p - l * s` must round twice, as numpy does). -fno-trapping-math only lets the
 * compiler compute both sides of a selection (no value changes). Rounding to nearest even
 * uses 2**23 (exact below it, see rne), not rintf, which is a library call without SSE4.1.
 *
 * Every exported function works on the element range [lo, hi) of its arrays, so that the
 * caller can split one call over threads (the ranges start on block and word boundaries).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef int64_t i64;
#define INL static inline __attribute__((always_inline))

/* Clones for x86-64's levels (baseline SSE2; v3: AVX2; v4: AVX-512), one picked when the
 * library is loaded: no -march=native, so a cache shared by the machines of a cluster stays
 * valid on each. The loader builds again with -DMXD_NO_CLONES if a compiler refuses them. */
#if defined(__x86_64__) && defined(__has_attribute) && !defined(MXD_NO_CLONES)
#if __has_attribute(target_clones)
#define CLONES __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
#endif
#endif
#ifndef CLONES
#define CLONES
#endif

INL uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
INL float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* numpy's rint (to nearest, ties to even): below 2**23, adding and subtracting 2**23 rounds
 * in the default mode; from 2**23 on (and inf, NaN) a float32 is already integral. */
INL float rne(float q) {
    const float two23 = 8388608.0f;
    float a = fabsf(q);
    float r = copysignf((a + two23) - two23, q);
    return a < two23 ? r : q;
}

/* ---- pushes: blockwise levels packed into normal float32 words (kvstore_ext.quantize) ---- */

/* A code below 2 * 254 * 2**23 as a normal float32: mantissa, exponent field, sign. */
INL uint32_t code_word(uint32_t x) {
    uint32_t high = x >> 23, sign = high >= 254u;
    return (sign << 31) | ((high - 254u * sign + 1u) << 23) | (x & 0x7fffffu);
}

/* Digits of one tile before they are packed; a multiple of 4, 8 and 20 ('int8', 'int4',
 * 'ternary'), small enough to stay in the first-level cache with the tile's values. */
#define TILE 2560

INL void pack(const uint8_t *restrict digits, i64 words, uint32_t *restrict out,
              const uint32_t L, const int D) {
    for (i64 w = 0; w < words; w++) {
        const uint8_t *d = digits + w * D;
        uint32_t x = d[D - 1];
        for (int j = D - 2; j >= 0; j--) x = x * L + d[j];
        out[w] = code_word(x);
    }
}

/* max |p| of a block as float32 bits (|p| ordered as its bits; NaN above inf); with a
 * residual, p = g + r is stored into r on the way. */
INL uint32_t absmax_bits(const float *restrict g, float *restrict r, i64 m, const int RES) {
    uint32_t top = 0;
    for (i64 i = 0; i < m; i++) {
        float p = RES ? g[i] + r[i] : g[i];
        if (RES) r[i] = p;
        uint32_t a = f2u(p) & 0x7fffffffu;
        top = a > top ? a : top;
    }
    return top;
}

/* Levels of one tile of a block of scale s (0 < s < inf): c = l * s into `sent`, p - c
 * into r (with a residual), digits l + H. */
INL void quantize_tile(const float *restrict p, float *restrict sent, float *restrict r,
                       uint8_t *restrict digits, i64 m, float s, const int H, const int RES) {
    const float h = (float)H;
    for (i64 i = 0; i < m; i++) {
        float q = rne(p[i] / s);
        q = q < -h ? -h : q;
        q = q > h ? h : q;
        q = q + 0.0f;              /* -0 becomes +0, as numpy's levels += 0 */
        float c = q * s;
        sent[i] = c;
        if (RES) r[i] = p[i] - c;
        digits[i] = (uint8_t)((int)q + H);
    }
}

/* A block without levels (scale 0, inf or NaN): every level 0, c = 0 * s. */
INL void zero_tile(const float *restrict p, float *restrict sent, float *restrict r,
                   uint8_t *restrict digits, i64 m, float s, const int H, const int RES) {
    float c = 0.0f * s;
    for (i64 i = 0; i < m; i++) {
        sent[i] = c;
        if (RES) r[i] = p[i] - c;
        digits[i] = (uint8_t)H;
    }
}

INL void encode_range(const float *restrict g, float *restrict r, float *restrict sent,
                      float *restrict payload, i64 n, i64 block, i64 lo, i64 hi,
                      const int H, const uint32_t L, const int D, const int RES) {
    i64 blocks = (n + block - 1) / block;
    uint32_t *words = (uint32_t *)(payload + blocks) + lo / D;
    const float *p = RES ? r : g;
    uint8_t digits[TILE + 64];
    int k = 0;   /* digits held, not yet packed */
    for (i64 b0 = lo; b0 < hi; b0 += block) {
        i64 b1 = b0 + block < n ? b0 + block : n;
        uint32_t top = absmax_bits(g + b0, r + b0, b1 - b0, RES);
        float amax = u2f(top);
        if (top > 0x7f800000u) {
            /* numpy's max returns the block's NaN (the first, for one NaN pattern) */
            for (i64 i = b0; i < b1; i++) if (p[i] != p[i]) { amax = p[i]; break; }
        }
        float s = amax / (float)H + 0.0f;
        payload[b0 / block] = s;
        int levels = s > 0.0f && s < INFINITY;
        for (i64 i0 = b0; i0 < b1;) {
            i64 i1 = i0 + (TILE - k) < b1 ? i0 + (TILE - k) : b1;
            if (levels)
                quantize_tile(p + i0, sent + i0, r + i0, digits + k, i1 - i0, s, H, RES);
            else
                zero_tile(p + i0, sent + i0, r + i0, digits + k, i1 - i0, s, H, RES);
            k += (int)(i1 - i0);
            i0 = i1;
            if (k >= TILE) {
                int full = k / D;
                pack(digits, full, words, L, D);
                words += full;
                memmove(digits, digits + full * D, (size_t)(k - full * D));
                k -= full * D;
            }
        }
    }
    if (k) {   /* the chunk's last word: missing digits are level 0 */
        int full = (k + D - 1) / D;
        for (int j = k; j < full * D; j++) digits[j] = (uint8_t)H;
        pack(digits, full, words, L, D);
    }
}

/* The levels of words [w0, w1) into lev (float32): digit - H. Returns nonzero for a word that
 * pack cannot make (exponent field 0 or 255, or a code of more than D digits). Words of many
 * digits ('ternary') go by groups of 5 through a table of 3**5 rows. */
static float TERNARY5[243][8];

INL uint32_t unpack_words(const uint32_t *restrict words, i64 w0, i64 w1, float *restrict lev,
                          const int H, const uint32_t L, const int D, const uint32_t LIMIT) {
    uint32_t bad = 0;
    for (i64 w = w0; w < w1; w++) {
        uint32_t bits = words[w], e = (bits >> 23) & 0xffu;
        uint32_t x = (((bits >> 31) * 254u + e - 1u) << 23) | (bits & 0x7fffffu);
        uint32_t wrong = (e == 0u) | (e == 255u) | (x >= LIMIT);
        bad |= wrong;
        x = wrong ? 0u : x;   /* in the table's range; the caller raises */
        float *out = lev + (w - w0) * D;
        if (D == 20) {
            for (int j = 0; j < 4; j++) {   /* 8 floats copied, 5 kept: the next group's */
                uint32_t q = x / 243u;
                memcpy(out + 5 * j, TERNARY5[x - q * 243u], 8 * sizeof(float));
                x = q;
            }
        } else {
            for (int j = 0; j < D; j++) {
                uint32_t q = x / L;
                out[j] = (float)(int)(x - q * L) - (float)H;
                x = q;
            }
        }
    }
    return bad;
}

/* The sum over `rows` payloads (row order[j] of data, j = 0, 1, ... in that order) of the
 * values they stand for, elements [lo, hi) (lo a multiple of D): c_0 + c_1 + ... in float32,
 * left to right. Returns 0, or -1 - the first bad row (out is then partly written). */
INL i64 decode_range(const float *data, i64 stride, const i64 *order, i64 rows,
                     float *restrict out, i64 n, i64 block, i64 lo, i64 hi,
                     const int H, const uint32_t L, const int D, const uint32_t LIMIT) {
    i64 blocks = (n + block - 1) / block;
    const i64 span = (TILE / D) * D;
    float lev[TILE + 8];
    for (i64 t0 = lo; t0 < hi; t0 += span) {
        i64 t1 = t0 + span < hi ? t0 + span : hi;
        for (i64 row = 0; row < rows; row++) {
            const float *payload = data + order[row] * stride;
            if (unpack_words((const uint32_t *)(payload + blocks), t0 / D, (t1 + D - 1) / D,
                             lev, H, L, D, LIMIT))
                return -1 - order[row];
            for (i64 i0 = t0; i0 < t1;) {
                i64 b = i0 / block, i1 = (b + 1) * block < t1 ? (b + 1) * block : t1;
                float s = payload[b];
                const float *l = lev + (i0 - t0);
                float *o = out + i0;
                if (row == 0)
                    for (i64 i = 0; i < i1 - i0; i++) o[i] = l[i] * s;
                else
                    for (i64 i = 0; i < i1 - i0; i++) o[i] = o[i] + l[i] * s;
                i0 = i1;
            }
        }
    }
    return 0;
}

#define PUSH_CODEC(NAME, H, L, D, LIMIT)                                                       \
    CLONES i64 mxd_##NAME##_encode(const float *g, float *r, float *sent, float *payload,    \
                                   i64 n, i64 block, i64 lo, i64 hi) {                       \
        if (r) encode_range(g, r, sent, payload, n, block, lo, hi, H, L, D, 1);               \
        else encode_range(g, r, sent, payload, n, block, lo, hi, H, L, D, 0);                 \
        return 0;                                                                            \
    }                                                                                        \
    CLONES i64 mxd_##NAME##_decode_sum(const float *data, i64 stride, const i64 *order,      \
                                       i64 rows, float *out, i64 n, i64 block, i64 lo,       \
                                       i64 hi) {                                             \
        return decode_range(data, stride, order, rows, out, n, block, lo, hi, H, L, D,       \
                            LIMIT);                                                          \
    }

/* h, base 2h + 1, digits per word, base**digits */
PUSH_CODEC(int8, 127, 255u, 4, 4228250625u)
PUSH_CODEC(int4, 7, 15u, 8, 2562890625u)
PUSH_CODEC(ternary, 1, 3u, 20, 3486784401u)

/* ---- float16 (numpy's npy_floatbits_to_halfbits, which MXNet's cast matches) ---- */

INL uint16_t half_bits(float f) {
    uint32_t u = f2u(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    /* NaN: the top 10 bits of the significand, kept a NaN */
    uint32_t nan = 0x7c00u + ((a & 0x7fffffu) >> 13);
    nan = nan == 0x7c00u ? 0x7c01u : nan;
    uint32_t big = a > 0x7f800000u ? nan : 0x7c00u;               /* >= 65536, inf, NaN */
    uint32_t tiny = f2u(u2f(a) + 0.5f) - 0x3f000000u;              /* below 2**-14: units of
                                                                      2**-24, to even */
    uint32_t normal = (a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13;  /* rebias, round to even
                                                                      (65520 on: inf) */
    uint32_t h = a >= 0x47800000u ? big : (a < 0x38800000u ? tiny : normal);
    return (uint16_t)(h | sign);
}

INL float half_value(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, a = h & 0x7fffu;
    uint32_t e = a & 0x7c00u, o = a << 13;
    float sub = u2f(o + (113u << 23)) - u2f(113u << 23);   /* 0 and subnormals, exact */
    uint32_t bits = e == 0x7c00u ? o + (224u << 23) : (e == 0 ? f2u(sub) : o + (112u << 23));
    return u2f(bits | sign);
}

/* q = float16(d) with d = w - x (x NULL: d = w); MODE 0: cast only; 1: out = float32(q);
 * 2: x := x + float32(q) (out unused). */
INL void f16_encode_range(const float *restrict w, float *restrict x, float *restrict out,
                          uint16_t *restrict q, i64 lo, i64 hi, const int MODE) {
    for (i64 i = lo; i < hi; i++) {
        float d = MODE == 2 ? w[i] - x[i] : w[i];
        uint16_t h = half_bits(d);
        q[i] = h;
        if (MODE == 1) out[i] = half_value(h);
        if (MODE == 2) x[i] = x[i] + half_value(h);
    }
}

CLONES i64 mxd_f16_encode(const float *w, float *x, float *out, uint16_t *q, i64 lo, i64 hi) {
    if (x) f16_encode_range(w, x, out, q, lo, hi, 2);
    else if (out) f16_encode_range(w, x, out, q, lo, hi, 1);
    else f16_encode_range(w, x, out, q, lo, hi, 0);
    return 0;
}

/* ADD 0: out = float32(q); 1: out := out + float32(q). */
CLONES i64 mxd_f16_decode(const uint16_t *q, float *out, i64 add, i64 lo, i64 hi) {
    if (add)
        for (i64 i = lo; i < hi; i++) out[i] = out[i] + half_value(q[i]);
    else
        for (i64 i = lo; i < hi; i++) out[i] = half_value(q[i]);
    return 0;
}

/* ---- int8 pulls (kvstore_ext.pull_codecs.Int8Pull): a scale per block, bytes l + 128 ---- */

/* d = w - x (x NULL: d = w) of blocks [lo/block, hi/block), hi a multiple of block (the
 * last block padded with d = 0). With x: x := x + dec; without: out = dec (elements < n). */
INL void i8_encode_range(const float *restrict w, float *restrict x, float *restrict out,
                         float *restrict scales, uint8_t *restrict bytes, i64 n, i64 block,
                         i64 lo, i64 hi, const int MODEL) {
    for (i64 b0 = lo; b0 < hi; b0 += block) {
        i64 b1 = b0 + block < n ? b0 + block : (n > b0 ? n : b0);
        uint32_t top = 0;   /* padding: |0| */
        for (i64 i = b0; i < b1; i++) {
            float d = MODEL ? w[i] - x[i] : w[i];
            uint32_t a = f2u(d) & 0x7fffffffu;
            top = a > top ? a : top;
        }
        float amax = u2f(top);
        if (top > 0x7f800000u)
            for (i64 i = b0; i < b1; i++) {
                float d = MODEL ? w[i] - x[i] : w[i];
                if (d != d) { amax = fabsf(d); break; }
            }
        float s = amax / 127.0f;
        float safe = s > 0.0f ? s : 1.0f;
        scales[b0 / block] = s;
        for (i64 i = b0; i < b1; i++) {
            float d = MODEL ? w[i] - x[i] : w[i];
            float l = rne(d / safe);
            l = l < -127.0f ? -127.0f : l;   /* NaN stays NaN, as np.clip */
            l = l > 127.0f ? 127.0f : l;
            l = s == 0.0f ? 0.0f : l;
            l = l + 0.0f;
            float dec = l * s;
            if (MODEL) x[i] = x[i] + dec; else out[i] = dec;
            bytes[i] = l == l ? (uint8_t)(int)(l + 128.0f) : 0;   /* numpy: NaN -> 0 */
        }
        for (i64 i = b1; i < b0 + block; i++) bytes[i] = 128;   /* padding: level 0 */
    }
}

CLONES i64 mxd_i8pull_encode(const float *w, float *x, float *out, float *scales,
                             uint8_t *bytes, i64 n, i64 block, i64 lo, i64 hi) {
    if (x) i8_encode_range(w, x, out, scales, bytes, n, block, lo, hi, 1);
    else i8_encode_range(w, x, out, scales, bytes, n, block, lo, hi, 0);
    return 0;
}

/* out := out + (byte - 128) * scale, elements [lo, hi) (the workers' pulled model). */
CLONES i64 mxd_i8pull_decode_add(const float *scales, const uint8_t *bytes, float *out,
                                 i64 block, i64 lo, i64 hi) {
    for (i64 i0 = lo; i0 < hi;) {
        i64 b = i0 / block, i1 = (b + 1) * block < hi ? (b + 1) * block : hi;
        float s = scales[b];
        for (i64 i = i0; i < i1; i++) out[i] = out[i] + ((float)bytes[i] - 128.0f) * s;
        i0 = i1;
    }
    return 0;
}

/* The table of TERNARY5; called once when the library is loaded. */
i64 mxd_init(void) {
    for (int x = 0; x < 243; x++) {
        int v = x;
        for (int j = 0; j < 8; j++) {
            TERNARY5[x][j] = j < 5 ? (float)(v % 3) - 1.0f : 0.0f;
            v /= 3;
        }
    }
    return 0;
}
