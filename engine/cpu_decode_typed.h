/* The typed half of engine/cpu_decode.c, included once per weight type: WT is the type the
 * model's weights, norms, embedding and KV cache are stored in, LD1 / LD8 read one / eight of
 * them as fp32, ST1 rounds an fp32 value to WT for the cache. Arithmetic is fp32 either way.
 * NAME(f) gives each function the type's suffix. The type's macros are undefined at the end,
 * for the next instantiation. */

/* Y[b, o0:o1] = W[o0:o1] X[b] for a column-major W: each row's y accumulates x[i] times the
 * contiguous run W[o0:o1, i], four columns at a time; the four runs are reused for every row
 * while they are in the core's cache. */
static void NAME(lin_columns)(const Lin *l, long B, const float *X, long xs, float *Y, long ys, long o0,
                        long o1) {
    const long n = l->in, cs = l->cs;
    for (long b = 0; b < B; b++)
        for (long o = o0; o < o1; o++) Y[b * ys + o] = 0.f;
    long i = 0;
    for (; i + 4 <= n; i += 4) {
        const WT *w0 = (const WT *)l->w + i * cs, *w1 = w0 + cs, *w2 = w1 + cs, *w3 = w2 + cs;
        for (long b = 0; b < B; b++) {
            const float *x = X + b * xs;
            const float x0 = x[i], x1 = x[i + 1], x2 = x[i + 2], x3 = x[i + 3];
            float *y = Y + b * ys;
#pragma omp simd
            for (long o = o0; o < o1; o++)
                y[o] += x0 * LD1(w0[o]) + x1 * LD1(w1[o]) + x2 * LD1(w2[o]) + x3 * LD1(w3[o]);
        }
    }
    for (; i < n; i++) {
        const WT *w = (const WT *)l->w + i * cs;
        for (long b = 0; b < B; b++) {
            const float xi = X[b * xs + i];
            float *y = Y + b * ys;
#pragma omp simd
            for (long o = o0; o < o1; o++) y[o] += xi * LD1(w[o]);
        }
    }
}

/* out[3 r + q] = w_q . x_r for three weight rows w0..w2 and four inputs x0..x3 of n features:
 * twelve sums in twelve registers, each weight and input vector loaded once per 8 features
 * (7 loads for 12 multiply-adds). */
static void NAME(dot3x4)(const WT *const w[3], const float *const x[4], long n, float *out) {
    __m256 acc[12];
    for (int k = 0; k < 12; k++) acc[k] = _mm256_setzero_ps();
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 u = LD8(w[0] + i), v = LD8(w[1] + i);
        const __m256 t = LD8(w[2] + i);
        for (int r = 0; r < 4; r++) {
            const __m256 xv = _mm256_loadu_ps(x[r] + i);
            acc[3 * r] = _mm256_fmadd_ps(u, xv, acc[3 * r]);
            acc[3 * r + 1] = _mm256_fmadd_ps(v, xv, acc[3 * r + 1]);
            acc[3 * r + 2] = _mm256_fmadd_ps(t, xv, acc[3 * r + 2]);
        }
    }
    for (int k = 0; k < 12; k++) out[k] = hsum(acc[k]);
    for (; i < n; i++)
        for (int r = 0; r < 4; r++)
            for (int q = 0; q < 3; q++) out[3 * r + q] += LD1(w[q][i]) * x[r][i];
}

/* Y[b, o0:o1] = W[o0:o1] X[b] for a row-major W. One row: four weight rows at a time, so four
 * independent sums are in flight. Several: three weight rows against four inputs at a time
 * (twelve sums); the three weight rows are read from memory once and from the cache for the
 * next inputs. */
static void NAME(lin_rows)(const Lin *l, long B, const float *X, long xs, float *Y, long ys, long o0,
                     long o1) {
    const long n = l->in, rs = l->rs;
    long o = o0;
    if (B == 1) {
        const float *x = X;
        for (; o + 4 <= o1; o += 4) {
            const WT *w0 = (const WT *)l->w + o * rs, *w1 = w0 + rs, *w2 = w1 + rs, *w3 = w2 + rs;
            __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
            /* the next four rows, where this thread reads them next (else these rows again) */
            const WT *n0 = o + 8 <= o1 ? w0 + 4 * rs : w0, *n2 = n0 + 2 * rs;
            (void)n2;
            long i = 0;
            for (; i + 8 <= n; i += 8) {
                PREFETCH_NEXT(n0 + i, n2 + i);
                const __m256 xv = _mm256_loadu_ps(x + i);
                s0 = _mm256_fmadd_ps(LD8(w0 + i), xv, s0);
                s1 = _mm256_fmadd_ps(LD8(w1 + i), xv, s1);
                s2 = _mm256_fmadd_ps(LD8(w2 + i), xv, s2);
                s3 = _mm256_fmadd_ps(LD8(w3 + i), xv, s3);
            }
            float a0 = hsum(s0), a1 = hsum(s1), a2 = hsum(s2), a3 = hsum(s3);
            for (; i < n; i++) {
                a0 += LD1(w0[i]) * x[i];
                a1 += LD1(w1[i]) * x[i];
                a2 += LD1(w2[i]) * x[i];
                a3 += LD1(w3[i]) * x[i];
            }
            Y[o] = a0;
            Y[o + 1] = a1;
            Y[o + 2] = a2;
            Y[o + 3] = a3;
        }
    }
    for (; o < o1; o += 3) {
        const long nw = o1 - o < 3 ? o1 - o : 3;
        /* weight rows past o1 and inputs past the last row repeat the first; their sums are not
         * stored */
        const WT *lw = (const WT *)l->w;
        const WT *w[3] = {lw + o * rs, lw + (o + (nw > 1)) * rs, lw + (o + 2 * (nw > 2)) * rs};
        for (long b = 0; b < B; b += 4) {
            const long nb = B - b < 4 ? B - b : 4;
            const float *x[4];
            for (long r = 0; r < 4; r++) x[r] = X + (b + (r < nb ? r : 0)) * xs;
            float sums[12];
            NAME(dot3x4)(w, x, n, sums);
            for (long r = 0; r < nb; r++)
                for (long q = 0; q < nw; q++) Y[(b + r) * ys + o + q] = sums[3 * r + q];
        }
    }
}

/* Inside the team: each thread takes a contiguous block of output rows (a multiple of 16), then
 * all wait, so that Y is complete for whatever runs next. */
static void NAME(lin)(const Lin *l, long B, const float *X, long xs, float *Y, long ys) {
    const long t = omp_get_thread_num(), n = omp_get_num_threads();
    long per = (l->out + n - 1) / n;
    per = (per + 15) & ~15L;
    const long o0 = t * per, o1 = o0 + per < l->out ? o0 + per : l->out;
    if (o0 < o1) {
        if (l->qbits)
            lin_quant(l, B, X, xs, Y, ys, o0, o1);
        else if (l->cs == 1)
            NAME(lin_rows)(l, B, X, xs, Y, ys, o0, o1);
        else
            NAME(lin_columns)(l, B, X, xs, Y, ys, o0, o1);
        if (l->b)
            for (long b = 0; b < B; b++)
                for (long o = o0; o < o1; o++) Y[b * ys + o] += LD1(((const WT *)l->b)[o]);
    }
#pragma omp barrier
}

static void NAME(rms_norm)(const float *x, const void *weight, float eps, float *y, long n) {
    const WT *w = (const WT *)weight;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (long i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.f / sqrtf(ss / (float)n + eps);
    for (long i = 0; i < n; i++) y[i] = LD1(w[i]) * (x[i] * r);
}

/* One query head of one row over that row's slots 0..S-1 of kv head j: out [D]; `sc` holds S
 * scores. Dense rows (`bt` NULL): `k` and `v` point at the row's slot 0, kv head j. Paged rows:
 * `k` and `v` point at block 0's slot 0, kv head j, and slot s is in block bt[s / bs] (blocks
 * `rs` apart) at offset s % bs; the slots of one block are read as one run. */
static void NAME(attend)(const Model *m, const WT *k, const WT *v, long ss, const long long *bt,
                   long bs, long rs, const float *q, long S, const unsigned char *mask,
                   float *sc, float *out) {
    const long D = m->D, run = bt ? bs : S;
    float mx = -INFINITY;
    for (long s0 = 0; s0 < S; s0 += run) {
        const WT *kb = bt ? k + bt[s0 / bs] * rs : k;
        const long n = S - s0 < run ? S - s0 : run;
        for (long o = 0; o < n; o++) {
            const long s = s0 + o;
            if (mask && !mask[s]) {
                sc[s] = -INFINITY;
                continue;
            }
            const WT *ks = kb + o * ss;
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (long d = 0; d < D; d++) acc += q[d] * LD1(ks[d]);
            sc[s] = acc * m->scale;
            if (sc[s] > mx) mx = sc[s];
        }
    }
    float sum = 0.f;
    for (long s = 0; s < S; s++) {
        sc[s] = sc[s] == -INFINITY ? 0.f : expf(sc[s] - mx);
        sum += sc[s];
    }
    for (long d = 0; d < D; d++) out[d] = 0.f;
    for (long s0 = 0; s0 < S; s0 += run) {
        const WT *vb = bt ? v + bt[s0 / bs] * rs : v;
        const long n = S - s0 < run ? S - s0 : run;
        for (long o = 0; o < n; o++) {
            const long s = s0 + o;
            if (sc[s] == 0.f) continue;
            const float p = sc[s] / sum;
            const WT *vs = vb + o * ss;
#pragma omp simd
            for (long d = 0; d < D; d++) out[d] += p * LD1(vs[d]);
        }
    }
}

/* Scratch floats, for B rows and T = 1 + the largest position: h, x [B E]; qkv [B (H + 2K) D];
 * att [B H D]; gate_up [B 2F]; act [B F]; cos, sin [B D/2]; scores [B H T] -- engine/
 * native_step.py sizes it with the same formula. */
static void NAME(decode)(const Model *m, long B, const long long *tokens,
                         const long long *positions, const long long *crows,
                         const unsigned char *mask, long mask_stride, const long long *bt,
                         long nb, long bs, float *logits, float *scratch, int threads) {
    const long E = m->E, H = m->H, K = m->K, D = m->D, F = m->F, half = D / 2, G = H / K;
    const long Q = (H + 2 * K) * D;
    long T = 0;
    for (long b = 0; b < B; b++)
        if (positions[b] + 1 > T) T = positions[b] + 1;
    float *h = scratch, *x = h + B * E, *qkv = x + B * E, *att = qkv + B * Q;
    float *gu = att + B * H * D, *act = gu + B * 2 * F, *cs = act + B * F, *sn = cs + B * half;
    float *scores = sn + B * half;
    for (long b = 0; b < B; b++) {
        if (m->qembed.qbits) { /* rounded to the model's type, as the torch lookup's rows */
            q_row(&m->qembed, tokens[b], h + b * E);
            for (long i = 0; i < E; i++) h[b * E + i] = LD1(ST1(h[b * E + i]));
        } else {
            const WT *row = (const WT *)m->embed + tokens[b] * E;
            for (long i = 0; i < E; i++) h[b * E + i] = LD1(row[i]);
        }
        for (long j = 0; j < half; j++) {
            const float f = (float)positions[b] * m->inv_freq[j];
            cs[b * half + j] = cosf(f) * m->rope_scale;
            sn[b * half + j] = sinf(f) * m->rope_scale;
        }
    }
#pragma omp parallel num_threads(threads)
    {
        for (long l = 0; l < m->L; l++) {
            const Layer *ly = &m->layers[l];
#pragma omp for schedule(static)
            for (long b = 0; b < B; b++) NAME(rms_norm)(h + b * E, ly->norm1, ly->eps1, x + b * E, E);
            NAME(lin)(&ly->qkv, B, x, E, qkv, Q);
#pragma omp for schedule(static)
            for (long b = 0; b < B; b++) {
                const long pos = positions[b];
                const float *c = cs + b * half, *s = sn + b * half;
                for (long head = 0; head < H + K; head++) { /* rotate the q and k heads */
                    float *u = qkv + b * Q + head * D;
                    for (long j = 0; j < half; j++) {
                        const float u0 = u[j], u1 = u[j + half];
                        u[j] = u0 * c[j] - u1 * s[j];
                        u[j + half] = u1 * c[j] + u0 * s[j];
                    }
                }
                /* dense: row c's slot pos; paged: slot pos % bs of row c's block pos / bs */
                const long at = bt ? bt[CACHE_ROW(b) * nb + pos / bs] * ly->rs + pos % bs * ly->ss
                                   : CACHE_ROW(b) * ly->rs + pos * ly->ss;
                WT *kr = (WT *)ly->k + at;
                WT *vr = (WT *)ly->v + at;
                for (long j = 0; j < K; j++)
                    for (long d = 0; d < D; d++) {
                        kr[j * ly->ks + d] = ST1(qkv[b * Q + (H + j) * D + d]);
                        vr[j * ly->ks + d] = ST1(qkv[b * Q + (H + K + j) * D + d]);
                    }
            }
#pragma omp for schedule(static) collapse(2)
            for (long b = 0; b < B; b++)
                for (long head = 0; head < H; head++) {
                    const long j = head / G;
                    const long row = bt ? j * ly->ks : CACHE_ROW(b) * ly->rs + j * ly->ks;
                    NAME(attend)(m, (const WT *)ly->k + row, (const WT *)ly->v + row, ly->ss,
                           bt ? bt + CACHE_ROW(b) * nb : NULL, bs, ly->rs,
                           qkv + b * Q + head * D, positions[b] + 1,
                           mask ? mask + CACHE_ROW(b) * mask_stride : NULL, scores + (b * H + head) * T,
                           att + (b * H + head) * D);
                }
            NAME(lin)(&ly->o, B, att, H * D, x, E);
#pragma omp for schedule(static)
            for (long b = 0; b < B; b++) {
                for (long i = 0; i < E; i++) h[b * E + i] += x[b * E + i];
                NAME(rms_norm)(h + b * E, ly->norm2, ly->eps2, x + b * E, E);
            }
            NAME(lin)(&ly->gate_up, B, x, E, gu, 2 * F);
#pragma omp for schedule(static)
            for (long b = 0; b < B; b++)
                for (long i = 0; i < F; i++) {
                    const float g = gu[b * 2 * F + i];
                    act[b * F + i] = g / (1.f + expf(-g)) * gu[b * 2 * F + F + i];
                }
            NAME(lin)(&ly->down, B, act, F, x, E);
#pragma omp for schedule(static)
            for (long b = 0; b < B; b++)
                for (long i = 0; i < E; i++) h[b * E + i] += x[b * E + i];
        }
#pragma omp for schedule(static)
        for (long b = 0; b < B; b++) NAME(rms_norm)(h + b * E, m->final_norm, m->final_eps, x + b * E, E);
        NAME(lin)(&m->head, B, x, E, logits, m->V);
    }
}

#undef WT
#undef SFX
#undef LD1
#undef LD8
#undef ST1
#undef PREFETCH_NEXT
