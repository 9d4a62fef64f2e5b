/* Q8_0 decode kernels on AVX2, in cache, one thread: how many cycles a (weight row, block)
 * takes in the file's layout and in an 8-row interleaved layout, and the throughput of the
 * instructions they are made of. Written to find what bounds Q8_0 decode on an AVX2-only
 * AMD EPYC (Zen 1), see docs/PERFORMANCE.md; not part of the build or of CI.
 *
 *   gcc -O2 -march=native scripts/q8_0-layouts.c -o /tmp/q8 && /tmp/q8
 *
 * "cycles" are nanoseconds times the clock that a chain of dependent adds shows. */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* The file's block, and eight rows' blocks interleaved by 4 bytes: bytes 4j..4j+4 of row r at
 * qs[32 j + 4 r], so that one 32-byte load holds four weights of each of eight rows. */
typedef struct __attribute__((packed)) { unsigned short d; signed char qs[32]; } blk;
typedef struct { unsigned short d[8]; signed char qs[256]; } blk8;
#define K 1024
#define NB (K / 32)
#define ROWS 128

static float hsum(__m256 a) {
    float l[8];
    _mm256_storeu_ps(l, a);
    return l[0] + l[1] + l[2] + l[3] + l[4] + l[5] + l[6] + l[7];
}

/* One row at a time, as tether's quant_dots and llama.cpp's vec_dot_q8_0_q8_0 do. */
__attribute__((noinline)) void rows(const blk *w, const signed char *xq, const float *xd, float *out) {
    __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < ROWS; r++) {
        const blk *row = w + r * NB;
        __m256 acc = _mm256_setzero_ps();
        for (int b = 0; b < NB; b++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)row[b].qs);
            __m256i x = _mm256_loadu_si256((const __m256i *)(xq + 32 * b));
            __m256i p = _mm256_madd_epi16(
                _mm256_maddubs_epi16(_mm256_sign_epi8(v, v), _mm256_sign_epi8(x, v)), ones);
            __m256 s = _mm256_set1_ps(_cvtsh_ss(row[b].d) * xd[b]);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc);
        }
        out[r] = hsum(acc);
    }
}

/* Eight rows at a time from the interleaved layout, one i32 lane per row. */
__attribute__((noinline)) void interleaved(const blk8 *w, const signed char *xq, const float *xd, float *out) {
    __m256i ones = _mm256_set1_epi16(1);
    for (int g = 0; g < ROWS / 8; g++) {
        const blk8 *row = w + g * NB;
        __m256 acc = _mm256_setzero_ps();
        for (int b = 0; b < NB; b++) {
            __m256i dots = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(row[b].qs + 32 * j));
                int word;
                memcpy(&word, xq + 32 * b + 4 * j, 4);
                __m256i x = _mm256_set1_epi32(word);
                dots = _mm256_add_epi32(dots, _mm256_madd_epi16(
                    _mm256_maddubs_epi16(_mm256_sign_epi8(v, v), _mm256_sign_epi8(x, v)), ones));
            }
            __m256 s = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)row[b].d)),
                                     _mm256_set1_ps(xd[b]));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), s, acc);
        }
        _mm256_storeu_ps(out + 8 * g, acc);
    }
}

#define N 50000000L
#define T(name, type, set, op)                                                                   \
    {                                                                                            \
        type a0 = set(1), a1 = set(2), a2 = set(3), a3 = set(4), a4 = set(5), a5 = set(6),       \
             a6 = set(7), a7 = set(8), a8 = set(9), a9 = set(10), b = set(3);                    \
        __asm__ volatile("" : "+x"(b));                                                          \
        double t = now();                                                                        \
        for (long i = 0; i < N; i++) {                                                           \
            a0 = op(a0, b); a1 = op(a1, b); a2 = op(a2, b); a3 = op(a3, b); a4 = op(a4, b);      \
            a5 = op(a5, b); a6 = op(a6, b); a7 = op(a7, b); a8 = op(a8, b); a9 = op(a9, b);      \
            __asm__ volatile("" ::"x"(a0), "x"(a1), "x"(a2), "x"(a3), "x"(a4), "x"(a5),          \
                             "x"(a6), "x"(a7), "x"(a8), "x"(a9));                                 \
        }                                                                                        \
        printf("%-22s %.2f cycles each\n", name, (now() - t) / N / 10 * ghz * 1e9);                  \
    }

int main(void) {
    long x = 0;
    double t = now();
    for (long i = 0; i < 4 * N; i++) __asm__ volatile("add $1, %0" : "+r"(x));
    double ghz = 4 * N / (now() - t) / 1e9;
    printf("clock from dependent adds: %.2f GHz\n", ghz);
    T("vpmaddubsw ymm", __m256i, _mm256_set1_epi8, _mm256_maddubs_epi16)
    T("vpmaddubsw xmm", __m128i, _mm_set1_epi8, _mm_maddubs_epi16)
    T("vpmaddwd ymm", __m256i, _mm256_set1_epi8, _mm256_madd_epi16)
    T("vpsignb ymm", __m256i, _mm256_set1_epi8, _mm256_sign_epi8)
    T("vpunpckldq ymm", __m256i, _mm256_set1_epi8, _mm256_unpacklo_epi32)
    T("vphaddd ymm", __m256i, _mm256_set1_epi8, _mm256_hadd_epi32)

    blk *w = malloc(sizeof(blk) * ROWS * NB);
    blk8 *w8 = malloc(sizeof(blk8) * ROWS / 8 * NB);
    signed char xq[K];
    float xd[NB], o1[ROWS], o2[ROWS];
    srand(1);
    for (int i = 0; i < ROWS * NB; i++) {
        w[i].d = _cvtss_sh(0.01f * (rand() % 100 + 1), 0);
        for (int j = 0; j < 32; j++) w[i].qs[j] = rand() % 255 - 127;
    }
    for (int i = 0; i < K; i++) xq[i] = rand() % 255 - 127;
    for (int b = 0; b < NB; b++) xd[b] = 0.01f * (b + 1);
    for (int g = 0; g < ROWS / 8; g++)
        for (int b = 0; b < NB; b++)
            for (int r = 0; r < 8; r++) {
                w8[g * NB + b].d[r] = w[(8 * g + r) * NB + b].d;
                for (int j = 0; j < 8; j++)
                    memcpy(w8[g * NB + b].qs + 32 * j + 4 * r, w[(8 * g + r) * NB + b].qs + 4 * j, 4);
            }
    int it = 20000;
    t = now();
    for (int i = 0; i < it; i++) rows(w, xq, xd, o1);
    printf("file layout, one row:  %.2f cycles per row and block\n", (now() - t) / it / (ROWS * NB) * ghz * 1e9);
    t = now();
    for (int i = 0; i < it; i++) interleaved(w8, xq, xd, o2);
    printf("interleaved, 8 rows:   %.2f cycles per row and block\n", (now() - t) / it / (ROWS * NB) * ghz * 1e9);
    for (int r = 0; r < ROWS; r++)
        if (o1[r] != o2[r] && (o1[r] - o2[r]) * (o1[r] - o2[r]) > 1e-6 * o1[r] * o1[r]) {
            printf("row %d differs: %f %f\n", r, o1[r], o2[r]);
            return 1;
        }
    return 0;
}
