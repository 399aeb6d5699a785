/* The C decode step's matrix-vector products in isolation, against a read-bandwidth roofline:
 * SmolLM2-135M's decoder matrices (30 layers of q|k|v 960x576, o 576x576, gate|up 3072x576,
 * down 576x1536) and its tied 49152x576 fp32 head, filled with random codes/weights, one
 * batch-1 pass = every product once, in one OpenMP team, through the same `lin_f32` the
 * step calls (engine/cpu_decode.c is included whole, so the kernels are the build's own).
 *
 *   PY=$(python -c 'import sysconfig; print(sysconfig.get_config_var("prefix"))')
 *   gcc -O3 -mavx2 -mfma -mf16c -fopenmp -I$PY/include/python3.11 bench/quant_matvec.c \
 *       -o /tmp/quant_matvec -L$PY/lib -lpython3.11 -Wl,-rpath,$PY/lib -lm
 *   /tmp/quant_matvec BITS GROUP AFFINE THREADS REPEATS [HEAD [LAYERS]]
 *   /tmp/quant_matvec bw THREADS
 *
 * BITS 0 (fp32 weights), 8 or 4; GROUP 0 = one group a row; HEAD 1 (default) adds the fp32
 * head, 8 the int8 one with a scale a row (what `convert --quantize` writes), 0 leaves it out;
 * LAYERS fewer than 30 makes the matrices fit the cache (the kernels' compute bound). Prints
 * the bytes a pass streams (codes + scales + zero points + fp32 weights), the best and mean
 * pass and the bytes/s of the best. One thread is timed in thread CPU time (a shared machine's
 * other processes then cost it less), several in wall time. `bw` prints the best bytes/s of an
 * AVX2 sum over 256 MiB (same clocks), the roofline. */
#include "../engine/cpu_decode.c"

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static int cpu_clock;

static double now(void) {
    struct timespec t;
    clock_gettime(cpu_clock ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static unsigned seed = 12345;
static unsigned rnd(void) {
    seed = seed * 1103515245u + 12345u;
    return seed >> 8;
}

static const long SHAPES[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};

static double bytes_of(const Lin *l) {
    if (!l->qbits) return 4.0 * l->out * l->in;
    const long groups = l->in / l->group;
    return (double)l->out * l->in * l->qbits / 8 + (double)l->out * groups * (4 + (l->zero != NULL));
}

static void make(Lin *l, long out, long in, int bits, long group, int affine) {
    memset(l, 0, sizeof *l);
    l->out = out, l->in = in, l->cs = 1, l->qbits = bits;
    if (!bits) {
        float *w = aligned_alloc(64, out * in * 4);
        for (long i = 0; i < out * in; i++) w[i] = ((int)(rnd() % 2001) - 1000) * 1e-4f;
        l->w = w, l->rs = in;
        return;
    }
    l->group = group ? group : in;
    const long groups = in / l->group, rs = bits == 8 ? in : in / 2;
    uint8_t *codes = aligned_alloc(64, (out * rs + 63) / 64 * 64);
    for (long i = 0; i < out * rs; i++) codes[i] = (uint8_t)rnd();
    float *scale = malloc(out * groups * sizeof *scale);
    for (long i = 0; i < out * groups; i++) scale[i] = 1e-3f * (1 + rnd() % 100);
    l->w = codes, l->rs = rs, l->scale = scale;
    if (affine) {
        int8_t *zero = malloc(out * groups);
        for (long i = 0; i < out * groups; i++) zero[i] = (int8_t)((int)(rnd() % 16) - 8);
        l->zero = zero;
    }
}

static int bandwidth(int threads) {
    const long n = 256L << 20, m = n / 4;
    float *a = aligned_alloc(64, n);
    memset(a, 1, n);
    double best = 1e9;
    for (int r = 0; r < 10; r++) {
        const double t0 = now();
        float total = 0.f;
#pragma omp parallel num_threads(threads) reduction(+ : total)
        {
            __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
#pragma omp for schedule(static)
            for (long i = 0; i < m; i += 32) {
                s0 = _mm256_add_ps(s0, _mm256_load_ps(a + i));
                s1 = _mm256_add_ps(s1, _mm256_load_ps(a + i + 8));
                s2 = _mm256_add_ps(s2, _mm256_load_ps(a + i + 16));
                s3 = _mm256_add_ps(s3, _mm256_load_ps(a + i + 24));
            }
            total += hsum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
        }
        const double t = now() - t0;
        if (t < best) best = t;
        if (total == 42.f) puts(""); /* keeps the sum */
    }
    printf("read bandwidth, %d thread(s): %.1f GB/s\n", threads, n / best / 1e9);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 3 && !strcmp(argv[1], "bw")) {
        cpu_clock = atoi(argv[2]) == 1; /* the same clock as the products' */
        return bandwidth(atoi(argv[2]) > 0 ? atoi(argv[2]) : 1);
    }
    if (argc < 6) {
        fprintf(stderr, "usage: %s BITS GROUP AFFINE THREADS REPEATS [HEAD [LAYERS]] | bw THREADS\n",
                argv[0]);
        return 2;
    }
    const int bits = atoi(argv[1]), affine = atoi(argv[3]), threads = atoi(argv[4]);
    const long group = atol(argv[2]);
    const int repeats = atoi(argv[5]), head = argc > 6 ? atoi(argv[6]) : 1;
    const int layers = argc > 7 ? atoi(argv[7]) : 30;
    if ((bits != 0 && bits != 8 && bits != 4) || threads < 1 || repeats < 2 || layers < 1 ||
        layers > 30 || (head != 0 && head != 1 && head != 8) ||
        (group && (group % 8 || 576 % group || 1536 % group))) {
        fprintf(stderr, "BITS 0/8/4, GROUP 0 or a multiple of 8 dividing 576 and 1536, "
                        "THREADS >= 1, REPEATS >= 2, HEAD 0/1/8, LAYERS 1..30\n");
        return 2;
    }
    cpu_clock = threads == 1;
    static Lin lins[30 * 4 + 1];
    int n = 0;
    for (int l = 0; l < layers; l++)
        for (int k = 0; k < 4; k++) make(&lins[n++], SHAPES[k][0], SHAPES[k][1], bits, group, affine);
    if (head) make(&lins[n++], 49152, 576, head == 8 ? 8 : 0, 0, 0);
    double bytes = 0;
    for (int i = 0; i < n; i++) bytes += bytes_of(&lins[i]);
    float *x = aligned_alloc(64, 4 * 1536), *y = aligned_alloc(64, 4 * 49152);
    for (int i = 0; i < 1536; i++) x[i] = ((int)(rnd() % 2001) - 1000) * 1e-3f;
    double best = 1e9, total = 0;
    for (int r = 0; r < repeats; r++) {
        const double t0 = now();
#pragma omp parallel num_threads(threads)
        for (int i = 0; i < n; i++) lin_f32(&lins[i], 1, x, lins[i].in, y, lins[i].out);
        const double t = now() - t0;
        if (t < best) best = t;
        if (r) total += t; /* the first pass warms up */
    }
    double check = 0;
    for (int i = 0; i < 576; i++) check += y[i];
    printf("bits %d group %ld affine %d threads %d head %d layers %d: %.1f MB a pass, best %.2f ms "
           "(%.1f GB/s), mean %.2f ms, check %g\n",
           bits, group, affine, threads, head, layers, bytes / 1e6, best * 1e3, bytes / best / 1e9,
           total / (repeats - 1) * 1e3, check);
    return 0;
}
