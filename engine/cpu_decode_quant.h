/* Products over weight-only quantized matrices for engine/cpu_decode.c: int8 codes (one byte a
 * weight) or int4 codes (two a byte, element 2j in the low nibble), one fp32 scale per group of
 * `group` inputs of a row and, for affine schemes, one int8 zero point per group
 * (kernels/quant_linear.py holds them). The weight is (code - zero) * scale; here the codes are
 * widened to fp32 in registers and multiply the fp32 input, each group's sum of code * input is
 * scaled once, and every sum is fp32. The float weight is never written anywhere, so a step
 * streams the codes' bytes only: a quarter (int8) or an eighth (int4) of fp32's, plus the scales.
 * The input stays fp32 (it is not rounded to int8 as llama.cpp's Q8_0 dot products do), so the
 * result is the dequantized weight's F.linear to fp32 rounding (tested).
 *
 * Zero points: sum_i (c_i - z) x_i = sum_i c_i x_i - z sum_i x_i, the groups' input sums taken
 * once per product (q_group_sums) rather than one subtract per weight.
 *
 * int4 without unpacking shuffles: eight packed bytes widened to eight 32-bit lanes hold codes
 * 0,2,..,14 in their low nibbles and 1,3,..,15 in their high ones. Shifting a lane's wanted
 * nibble to the top four bits gives code * 2^28 as a signed int32, exactly; converted to fp32
 * (exact: four significant bits) it multiplies the input, and the group's scale * 2^-28 undoes
 * the power of two, so the sum is that of code * input with the same roundings, scaled. The
 * inputs are read in the same even/odd order: each thread reorders x once per product into a
 * buffer of its own (q_inputs), 16 inputs at a time; a group whose size is 8 past a multiple of
 * 16 reads its last 8 in natural order (q4_load8), as does every group when the buffer cannot
 * be allocated.
 *
 * Measured on the 2-core AMD EPYC (Zen 4) with SmolLM2-135M's 30 layers in isolation (one
 * thread): the previous kernels (pshufb/variable-shift unpacking, one sum a row, prefetch four
 * rows ahead) read int8 codes at 4.8 GB/s and int4 at 2.6 GB/s from memory, against 26 / 5.7
 * GB/s from cache: int8 waited on memory, int4 on unpacking. See bench/RESULTS.md for these.
 *
 * The group size is a multiple of 8 (engine/native_step.py checks; others run in torch). */

/* out[i] = row r of the weight, (code - zero) * scale in fp32 (one rounding, as
 * kernels.quantization.dequantize_weight): a quantized embedding's lookup, one row a token. */
static void q_row(const Lin *l, long r, float *out) {
    const long n = l->in, G = l->group, groups = n / G;
    const uint8_t *row = (const uint8_t *)l->w + r * l->rs;
    for (long g = 0; g < groups; g++) {
        const float s = l->scale[r * groups + g];
        const int z = l->zero ? l->zero[r * groups + g] : 0;
        for (long i = g * G; i < (g + 1) * G; i++) {
            int c;
            if (l->qbits == 8)
                c = ((const int8_t *)row)[i];
            else {
                c = i & 1 ? row[i / 2] >> 4 : row[i / 2] & 15;
                c = c >= 8 ? c - 16 : c;
            }
            out[i] = (float)(c - z) * s;
        }
    }
}

/* Eight int8 codes as fp32. */
static inline __m256 q8_load8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* Eight int4 codes from four bytes (low nibble first), in natural order, as fp32 code * 2^28:
 * each byte goes to two 32-bit lanes, and the lane's nibble is shifted to the top four bits. */
static inline __m256 q4_load8(const uint8_t *p) {
    int32_t word;
    memcpy(&word, p, sizeof word);
    const __m128i dup = _mm_shuffle_epi8(
        _mm_cvtsi32_si128(word), _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1, -1, -1, -1, -1, -1));
    const __m256i v = _mm256_sllv_epi32(_mm256_cvtepu8_epi32(dup), _mm256_setr_epi32(28, 24, 28, 24, 28, 24, 28, 24));
    /* the odd lanes' low nibble (the even code) sits under the high one: cleared */
    return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xF0000000u)));
}

/* Sixteen int4 codes from eight bytes as fp32 code * 2^28: the even codes (0, 2, .., 14) and
 * the odd ones (1, 3, .., 15). */
static inline __attribute__((always_inline)) void q4_load16(const uint8_t *p, __m256 *even, __m256 *odd) {
    const __m256i lanes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *even = _mm256_cvtepi32_ps(_mm256_slli_epi32(lanes, 28));
    *odd = _mm256_cvtepi32_ps(_mm256_slli_epi32(_mm256_and_si256(lanes, _mm256_set1_epi32(0xF0)), 24));
}

/* How far ahead of the codes being read their lines are asked for, in bytes of the thread's
 * rows (contiguous: row-major codes). A row of codes is short (9 lines for 576 int8 inputs), so
 * the hardware prefetcher barely starts on a row before the next begins; one line is asked for
 * per 64 bytes consumed, this far ahead. */
#define Q_PREFETCH 4096

/* The inputs x[n] in the order the int4 loop reads them (16 at a time: the 8 even then the 8
 * odd, a group's last 8 when the group size is 8 past a multiple of 16 as they are) into `xp`. */
static void q_reorder(const float *x, long n, long G, float *xp) {
    for (long g0 = 0; g0 < n; g0 += G) {
        long i = g0;
        for (; i + 16 <= g0 + G; i += 16)
            for (long j = 0; j < 8; j++) {
                xp[i + j] = x[i + 2 * j];
                xp[i + 8 + j] = x[i + 2 * j + 1];
            }
        for (; i < g0 + G; i++) xp[i] = x[i];
    }
}

/* sums[g] = the sum of x's inputs in group g (of `G`), in any order. */
static void q_group_sums(const float *x, long n, long G, float *sums) {
    for (long g0 = 0, g = 0; g0 < n; g0 += G, g++) {
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (long i = g0; i < g0 + G; i++) s += x[i];
        sums[g] = s;
    }
}

/* This thread's buffer of at least `floats` floats, kept for its next products (a pool thread
 * lives as long as the process); NULL when it cannot be had. */
static float *q_buffer(long floats) {
    static __thread float *buf;
    static __thread long cap;
    if (floats > cap) {
        void *p = NULL;
        if (posix_memalign(&p, 64, (size_t)floats * sizeof(float))) return NULL;
        free(buf);
        buf = p;
        cap = floats;
    }
    return buf;
}

/* out[r] = row (o + r) . x for r < 4 (rows past o1 repeat row o; their sums are not used): four
 * rows, two sums each (eight chains of multiply-adds in flight), each group's sums scaled into
 * its row's total. `bits` 8 or 4; `affine` 0: no zero points, 1: zero points with x's group
 * sums in `gsum`, 2: zero points, group sums taken here (no buffer could be had); `perm` whether
 * x is in q_reorder's order (int4). */
static inline __attribute__((always_inline)) void q_dot4(const Lin *l, const int bits,
                                                         const int affine, const int perm,
                                                         long o, long o1, const float *x,
                                                         const float *gsum, float out[4]) {
    const long n = l->in, G = l->group, groups = n / G, rs = l->rs;
    const uint8_t *row[4];
    const float *sc[4];
    const int8_t *zp[4];
    for (int r = 0; r < 4; r++) {
        const long orow = o + r < o1 ? o + r : o;
        row[r] = (const uint8_t *)l->w + orow * rs;
        sc[r] = l->scale + orow * groups;
        zp[r] = affine ? l->zero + orow * groups : NULL;
    }
    /* the thread's rows are one run of bytes: ask for the line Q_PREFETCH past the one being
     * consumed, never past the thread's last row */
    const char *pf = (const char *)row[0] + Q_PREFETCH;
    const char *pf_end = (const char *)l->w + o1 * rs;
    const float unit = bits == 4 ? 0x1p-28f : 1.f;
    __m256 total[4];
    float shift[4] = {0.f, 0.f, 0.f, 0.f}; /* sum over groups of zero * scale * group input sum */
    for (int r = 0; r < 4; r++) total[r] = _mm256_setzero_ps();
    for (long g = 0; g < groups; g++) {
        __m256 a[4], b[4], xsum = _mm256_setzero_ps();
        for (int r = 0; r < 4; r++) a[r] = b[r] = _mm256_setzero_ps();
        long i = g * G;
        const long end = (g + 1) * G;
        for (; i + 16 <= end; i += 16) {
            const long byte = bits == 8 ? i : i / 2; /* into each row */
            const long consumed = 4 * byte;          /* of the four rows' run, as if linear */
            if ((consumed & 63) == 0 && pf + consumed < pf_end)
                _mm_prefetch(pf + consumed, _MM_HINT_T0);
            const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
            if (affine == 2) xsum = _mm256_add_ps(xsum, _mm256_add_ps(x0, x1));
            for (int r = 0; r < 4; r++) {
                __m256 w0, w1;
                if (bits == 8) {
                    w0 = q8_load8((const int8_t *)row[r] + i);
                    w1 = q8_load8((const int8_t *)row[r] + i + 8);
                } else if (perm) {
                    q4_load16(row[r] + byte, &w0, &w1);
                } else {
                    w0 = q4_load8(row[r] + byte);
                    w1 = q4_load8(row[r] + byte + 4);
                }
                a[r] = _mm256_fmadd_ps(w0, x0, a[r]);
                b[r] = _mm256_fmadd_ps(w1, x1, b[r]);
            }
        }
        if (i < end) { /* 8 inputs left: read in natural order */
            const __m256 x0 = _mm256_loadu_ps(x + i);
            if (affine == 2) xsum = _mm256_add_ps(xsum, x0);
            for (int r = 0; r < 4; r++) {
                const __m256 w0 = bits == 8 ? q8_load8((const int8_t *)row[r] + i)
                                            : q4_load8(row[r] + i / 2);
                a[r] = _mm256_fmadd_ps(w0, x0, a[r]);
            }
        }
        const float xs = affine == 2 ? hsum(xsum) : 0.f;
        for (int r = 0; r < 4; r++) {
            const float s = sc[r][g];
            total[r] = _mm256_fmadd_ps(_mm256_add_ps(a[r], b[r]), _mm256_set1_ps(s), total[r]);
            if (affine == 2) shift[r] += (float)zp[r][g] * s * xs;
        }
    }
    if (affine == 1) /* the zero points' share, eight groups at a time */
        for (int r = 0; r < 4; r++) {
            __m256 acc = _mm256_setzero_ps();
            long g = 0;
            for (; g + 8 <= groups; g += 8) {
                const __m256 zs = _mm256_mul_ps(q8_load8(zp[r] + g), _mm256_loadu_ps(sc[r] + g));
                acc = _mm256_fmadd_ps(zs, _mm256_loadu_ps(gsum + g), acc);
            }
            shift[r] = hsum(acc);
            for (; g < groups; g++) shift[r] += (float)zp[r][g] * sc[r][g] * gsum[g];
        }
    /* int4 sums are of code * 2^28: scaled back (exactly: a power of two) */
    for (int r = 0; r < 4; r++) out[r] = hsum(total[r]) * unit - shift[r];
}

/* Y[b, o0:o1] = W[o0:o1] X[b], four weight rows at a time against every input row (the four
 * rows' codes stay in the core's cache from one input row to the next); one copy of the loop
 * per (bits, affine, perm), so none is tested inside it. `X` is in q_reorder's order when perm;
 * affine, `S` holds each input row's group sums, `gs` apart. */
#define LIN_QUANT(bits, affine, perm)                                                            \
    static void lin_quant_##bits##_##affine##_##perm(const Lin *l, long B, const float *X,      \
                                                     long xs, const float *S, long gs,          \
                                                     float *Y, long ys, long o0, long o1) {     \
        for (long o = o0; o < o1; o += 4) {                                                     \
            const long nr = o1 - o < 4 ? o1 - o : 4;                                            \
            for (long b = 0; b < B; b++) {                                                      \
                float sums[4];                                                                  \
                q_dot4(l, bits, affine, perm, o, o1, X + b * xs, S + b * gs, sums);             \
                for (long r = 0; r < nr; r++) Y[b * ys + o + r] = sums[r];                      \
            }                                                                                   \
        }                                                                                       \
    }
LIN_QUANT(8, 0, 0)
LIN_QUANT(8, 1, 0)
LIN_QUANT(4, 0, 0)
LIN_QUANT(4, 1, 0)
LIN_QUANT(4, 0, 1)
LIN_QUANT(4, 1, 1)
LIN_QUANT(8, 2, 0)
LIN_QUANT(4, 2, 0)
#undef LIN_QUANT

static void lin_quant(const Lin *l, long B, const float *X, long xs, float *Y, long ys, long o0,
                      long o1) {
    const long n = l->in, G = l->group, groups = n / G;
    const int perm = l->qbits == 4 && G >= 16;
    /* per input row: the reordered inputs (int4) and the group sums (affine) */
    const long row = (perm ? n : 0) + (l->zero ? groups : 0);
    float *buf = row ? q_buffer(B * row) : NULL;
    if (row && !buf) { /* no memory for the buffer: natural order, group sums in the loop */
        if (l->qbits == 8)
            lin_quant_8_2_0(l, B, X, xs, NULL, 0, Y, ys, o0, o1);
        else
            (l->zero ? lin_quant_4_2_0 : lin_quant_4_0_0)(l, B, X, xs, NULL, 0, Y, ys, o0, o1);
        return;
    }
    const float *S = buf + (perm ? B * n : 0);
    for (long b = 0; b < B; b++) {
        if (perm) q_reorder(X + b * xs, n, G, buf + b * n);
        if (l->zero) q_group_sums(X + b * xs, n, G, buf + (perm ? B * n : 0) + b * groups);
    }
    if (l->qbits == 8)
        (l->zero ? lin_quant_8_1_0 : lin_quant_8_0_0)(l, B, X, xs, S, groups, Y, ys, o0, o1);
    else if (perm)
        (l->zero ? lin_quant_4_1_1 : lin_quant_4_0_1)(l, B, buf, n, S, groups, Y, ys, o0, o1);
    else
        (l->zero ? lin_quant_4_1_0 : lin_quant_4_0_0)(l, B, X, xs, S, groups, Y, ys, o0, o1);
}
