/* The int8 multiply-add peak of this CPU: how many u8 x s8 products a second `threads` threads reach with the
 * instruction sequence tinyserve's int8 kernels use (tinyserve/kernels/int8_dot.py), run on registers only.
 *
 *     cc -O3 -march=native -fopenmp int8_peak.c -o int8_peak && ./int8_peak avx512vnni 2
 *
 * Each thread keeps ACC independent accumulators and feeds them the same two registers: no load, no store, no
 * memory traffic in the timed loop. The inputs come from argv so the compiler cannot fold them, and the
 * accumulators are summed and printed so it cannot drop the loop. Prints one JSON line:
 *     {"variant": ..., "threads": ..., "macs_per_s": ..., "macs_per_instruction": ..., "seconds": ...}
 * macs_per_s is the best of `repeat` timed runs (the least disturbed by other processes).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

#define INNER 64        /* instructions per accumulator per outer step */

/* Twelve independent accumulators as named variables (an array of vectors makes GCC copy them through memory on
 * every step): more than any of these instructions' latency x throughput, so the loop is limited by throughput,
 * and few enough to leave AVX2's 16 ymm room for the inputs and the constant. */
#define ACC 12
#define DECLARE(T, init) T c0 = init(0), c1 = init(1), c2 = init(2), c3 = init(3), c4 = init(4), c5 = init(5), \
    c6 = init(6), c7 = init(7), c8 = init(8), c9 = init(9), c10 = init(10), c11 = init(11)
/* An empty asm that "changes" the inputs: the compiler must redo the whole sequence every time (AVX2's vpmaddubsw
 * and vpmaddwd would otherwise be hoisted out of the loop as loop-invariant), and it costs no instruction. */
#if defined(__aarch64__)
#define OPAQUE(v) __asm__ volatile("" : "+w"(v))
#else
#define OPAQUE(v) __asm__ volatile("" : "+v"(v))
#endif
#define EACH(OP) OP(c0); OP(c1); OP(c2); OP(c3); OP(c4); OP(c5); OP(c6); OP(c7); OP(c8); OP(c9); OP(c10); OP(c11)

typedef struct { int64_t macs; int64_t sink; } result;

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
/* vpdpbusd zmm: 64 products u8 x s8, 4 summed into each of 16 int32 lanes, one instruction */
static result run_avx512vnni(int64_t steps, int a, int b) {
    __m512i x = _mm512_set1_epi8((char)a), w = _mm512_set1_epi8((char)b);
    DECLARE(__m512i, _mm512_set1_epi32);
#define STEP(c) c = _mm512_dpbusd_epi32(c, x, w)
    for (int64_t s = 0; s < steps; s++)
        for (int k = 0; k < INNER; k++) { OPAQUE(x); OPAQUE(w); EACH(STEP); }
#undef STEP
    int64_t sink = 0;
#define SUM(c) sink += _mm512_reduce_add_epi32(c)
    EACH(SUM);
#undef SUM
    return (result){steps * INNER * ACC * 64, sink};
}
#endif

#if defined(__AVX2__)
static int64_t sum256(__m256i v) {
    int32_t lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, v);
    int64_t s = 0;
    for (int j = 0; j < 8; j++) s += lanes[j];
    return s;
}
#endif

#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
/* vpdpbusd ymm: 32 products, one instruction (the VEX form on AVX-VNNI CPUs, the EVEX one on AVX-512 CPUs) */
static result run_avxvnni(int64_t steps, int a, int b) {
    __m256i x = _mm256_set1_epi8((char)a), w = _mm256_set1_epi8((char)b);
    DECLARE(__m256i, _mm256_set1_epi32);
#if defined(__AVXVNNI__)
#define STEP(c) c = _mm256_dpbusd_avx_epi32(c, x, w)
#else
#define STEP(c) c = _mm256_dpbusd_epi32(c, x, w)
#endif
    for (int64_t s = 0; s < steps; s++)
        for (int k = 0; k < INNER; k++) { OPAQUE(x); OPAQUE(w); EACH(STEP); }
#undef STEP
    int64_t sink = 0;
#define SUM(c) sink += sum256(c)
    EACH(SUM);
#undef SUM
    return (result){steps * INNER * ACC * 32, sink};
}
#endif

#if defined(__AVX2__)
/* AVX2 has no byte dot product: vpmaddubsw (u8 x s8 -> pairs summed in int16), vpmaddwd by ones (-> int32), vpaddd:
 * 32 products in three instructions. */
static result run_avx2(int64_t steps, int a, int b) {
    __m256i x = _mm256_set1_epi8((char)a), w = _mm256_set1_epi8((char)b), ones = _mm256_set1_epi16(1);
    DECLARE(__m256i, _mm256_set1_epi32);
/* x "changes" before each product, so each accumulator gets a product of its own, as in a kernel's tile */
#define STEP(c) OPAQUE(x); c = _mm256_add_epi32(c, _mm256_madd_epi16(_mm256_maddubs_epi16(x, w), ones))
    for (int64_t s = 0; s < steps; s++)
        for (int k = 0; k < INNER; k++) { OPAQUE(x); OPAQUE(w); EACH(STEP); }
#undef STEP
    int64_t sink = 0;
#define SUM(c) sink += sum256(c)
    EACH(SUM);
#undef SUM
    return (result){steps * INNER * ACC * 32, sink};
}
#endif

#if defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
/* sdot: 16 products s8 x s8, 4 summed into each of 4 int32 lanes */
static result run_neon(int64_t steps, int a, int b) {
    int8x16_t x = vdupq_n_s8((int8_t)a), w = vdupq_n_s8((int8_t)b);
    DECLARE(int32x4_t, vdupq_n_s32);
#define STEP(c) c = vdotq_s32(c, x, w)
    for (int64_t s = 0; s < steps; s++)
        for (int k = 0; k < INNER; k++) { OPAQUE(x); OPAQUE(w); EACH(STEP); }
#undef STEP
    int64_t sink = 0;
#define SUM(c) sink += vaddvq_s32(c)
    EACH(SUM);
#undef SUM
    return (result){steps * INNER * ACC * 16, sink};
}
#endif

typedef result (*kernel)(int64_t, int, int);

static kernel find(const char *name, int *per_instruction) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
    if (!strcmp(name, "avx512vnni")) { *per_instruction = 64; return run_avx512vnni; }
#endif
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
    if (!strcmp(name, "avxvnni")) { *per_instruction = 32; return run_avxvnni; }
#endif
#if defined(__AVX2__)
    if (!strcmp(name, "avx2")) { *per_instruction = 32; return run_avx2; }
#endif
#if defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
    if (!strcmp(name, "neon")) { *per_instruction = 16; return run_neon; }
#endif
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s VARIANT THREADS [STEPS [REPEAT]]  (VARIANT: avx512vnni | avxvnni | avx2 | neon)\n",
                argv[0]);
        return 2;
    }
    int per_instruction = 0;
    kernel k = find(argv[1], &per_instruction);
    if (!k) {
        fprintf(stderr, "int8_peak: this build has no %s kernel (the compiler's -march=native lacks its "
                        "instructions)\n", argv[1]);
        return 3;
    }
    int threads = atoi(argv[2]);
    int64_t steps = argc > 3 ? atoll(argv[3]) : 400000;
    int repeat = argc > 4 ? atoi(argv[4]) : 5;
    if (threads < 1 || steps < 1 || repeat < 1) {
        fprintf(stderr, "int8_peak: THREADS, STEPS and REPEAT must be >= 1\n");
        return 2;
    }
    int a = (int)strlen(argv[0]) | 1, b = -a;      /* not constants the compiler could see */
    omp_set_num_threads(threads);
    double best = 0, best_seconds = 0;
    int64_t sink = 0;
    for (int r = 0; r < repeat; r++) {
        int64_t macs = 0;
        double t0 = omp_get_wtime();
        #pragma omp parallel reduction(+ : macs, sink)
        {
            result res = k(steps, a, b);
            macs += res.macs;
            sink += res.sink;
        }
        double seconds = omp_get_wtime() - t0;
        if (macs / seconds > best) { best = macs / seconds; best_seconds = seconds; }
    }
    printf("{\"variant\": \"%s\", \"threads\": %d, \"macs_per_s\": %.6g, \"macs_per_instruction\": %d, "
           "\"seconds\": %.4f, \"sink\": %lld}\n", argv[1], threads, best, per_instruction, best_seconds,
           (long long)sink);
    return 0;
}
