/* Products over weight-only quantized matrices for engine/cpu_decode.c: int8 codes (one byte a
 * weight) or int4 codes (two a byte, element 2j in the low nibble), one fp32 scale per group of
 * `group` inputs of a row and, for affine schemes, one int8 zero point per group
 * (kernels/quant_linear.py holds them). The weight is (code - zero) * scale; here the codes are
 * widened to fp32 in registers, (code - zero) multiplies the input, each group's sum is scaled
 * once, and every sum is fp32. The float weight is never written anywhere, so a step streams the
 * codes' bytes only: a quarter (int8) or an eighth (int4) of fp32's, plus the scales.
 *
 * The group size is a multiple of 8 (engine/native_step.py checks; others run in torch). The
 * sums run in another order than the dequantized weight's F.linear, so results agree with it to
 * fp32 rounding (tested). */

/* Eight int8 codes as fp32. */
static inline __m256 q8_load8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* Eight int4 codes from four bytes (low nibble first) as fp32 in -8..7: each byte goes to two
 * 32-bit lanes, the odd lanes shift the high nibble down, and (v ^ 8) - 8 sign-extends. */
static inline __m256 q4_load8(const uint8_t *p) {
    int32_t word;
    memcpy(&word, p, sizeof word);
    const __m128i dup = _mm_shuffle_epi8(
        _mm_cvtsi32_si128(word), _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1, -1, -1, -1, -1, -1));
    __m256i v = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(dup), _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
    v = _mm256_and_si256(v, _mm256_set1_epi32(15));
    v = _mm256_sub_epi32(_mm256_xor_si256(v, _mm256_set1_epi32(8)), _mm256_set1_epi32(8));
    return _mm256_cvtepi32_ps(v);
}

/* Weights i..i+7 of the row starting at byte `row` (int8: one byte each, int4: half). */
static inline __attribute__((always_inline)) __m256 q_load8(int bits, const uint8_t *row, long i) {
    return bits == 8 ? q8_load8((const int8_t *)row + i) : q4_load8(row + i / 2);
}

/* out[r] = row (o + r) . x for r < 4 (rows past o1 repeat row o; their sums are not used):
 * four independent sums in flight, each group's partial sum scaled into its row's total. */
static inline __attribute__((always_inline)) void q_dot4(const Lin *l, const int bits,
                                                         const int affine, long o, long o1,
                                                         const float *x, float out[4]) {
    const long n = l->in, G = l->group, groups = n / G;
    const uint8_t *row[4], *next[4];
    const float *sc[4];
    const int8_t *zp[4];
    for (int r = 0; r < 4; r++) {
        const long orow = o + r < o1 ? o + r : o;
        row[r] = (const uint8_t *)l->w + orow * l->rs;
        next[r] = o + 4 + r < o1 ? row[r] + 4 * l->rs : row[r];
        sc[r] = l->scale + orow * groups;
        zp[r] = affine ? l->zero + orow * groups : NULL;
    }
    __m256 total[4];
    for (int r = 0; r < 4; r++) total[r] = _mm256_setzero_ps();
    for (long g = 0; g < groups; g++) {
        __m256 acc[4], z[4];
        for (int r = 0; r < 4; r++) {
            acc[r] = _mm256_setzero_ps();
            z[r] = _mm256_set1_ps(affine ? (float)zp[r][g] : 0.f);
        }
        for (long i = g * G; i < (g + 1) * G; i += 8) {
            /* a row of codes is short (8-16 cache lines for 1024 inputs): the hardware
             * prefetcher barely starts on it before the next four rows begin, so their lines
             * are asked for here, one per 64 bytes of codes (hidden-1024 model, one thread:
             * int8 steps 21.5 -> 15.3 ms, int4 20.3 -> 16.8 ms; fp32 weights 36.7 ms) */
            const long byte = bits == 8 ? i : i / 2;
            if ((byte & 63) == 0)
                for (int r = 0; r < 4; r++)
                    _mm_prefetch((const char *)(next[r] + byte), _MM_HINT_T0);
            const __m256 xv = _mm256_loadu_ps(x + i);
            for (int r = 0; r < 4; r++) {
                __m256 w = q_load8(bits, row[r], i);
                if (affine) w = _mm256_sub_ps(w, z[r]);
                acc[r] = _mm256_fmadd_ps(w, xv, acc[r]);
            }
        }
        for (int r = 0; r < 4; r++)
            total[r] = _mm256_fmadd_ps(acc[r], _mm256_set1_ps(sc[r][g]), total[r]);
    }
    for (int r = 0; r < 4; r++) out[r] = hsum(total[r]);
}

/* Y[b, o0:o1] = W[o0:o1] X[b], four weight rows at a time against every input row (the four
 * rows' codes stay in the core's cache from one input row to the next); one copy of the loop
 * per (bits, affine), so neither is tested inside it. */
#define LIN_QUANT(bits, affine)                                                                 \
    static void lin_quant_##bits##_##affine(const Lin *l, long B, const float *X, long xs,      \
                                            float *Y, long ys, long o0, long o1) {              \
        for (long o = o0; o < o1; o += 4) {                                                     \
            const long nr = o1 - o < 4 ? o1 - o : 4;                                            \
            for (long b = 0; b < B; b++) {                                                      \
                float sums[4];                                                                  \
                q_dot4(l, bits, affine, o, o1, X + b * xs, sums);                               \
                for (long r = 0; r < nr; r++) Y[b * ys + o + r] = sums[r];                      \
            }                                                                                   \
        }                                                                                       \
    }
LIN_QUANT(8, 0)
LIN_QUANT(8, 1)
LIN_QUANT(4, 0)
LIN_QUANT(4, 1)
#undef LIN_QUANT

static void lin_quant(const Lin *l, long B, const float *X, long xs, float *Y, long ys, long o0,
                      long o1) {
    if (l->qbits == 8)
        (l->zero ? lin_quant_8_1 : lin_quant_8_0)(l, B, X, xs, Y, ys, o0, o1);
    else
        (l->zero ? lin_quant_4_1 : lin_quant_4_0)(l, B, X, xs, Y, ys, o0, o1);
}
