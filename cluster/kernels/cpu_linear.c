/* bfloat16 linear layers on a CPU with AVX-512 BF16, in oneDNN's order of operations.
 *
 * `cluster/kernels/cpu_linear.py` builds this file (gcc -O3 -march=native
 * -ffp-contract=off, OpenMP), packs weights for it and calls `bf16_linear`; the torch
 * reference is `linear_ref` there (an emulation of the same order) and, bit for bit on
 * the CPUs where the engine uses this kernel, oneDNN's packed product.
 *
 * out[m, n] = sum over k of x[m, k] * w[n, k] (+ bias[n]), rounded once to bfloat16:
 * - float32 accumulators, one per output; `vdpbf16ps` adds the products of a pair of
 *   inputs (k = 2i + 1, then 2i, exact products) into it, pairs in increasing order;
 * - the pairs run in chunks of `k_block` inputs, each chunk's sum starting from zero and
 *   added to the running total when it ends (oneDNN's K blocking, which `cpu_linear.py`
 *   chooses and checks against oneDNN on this CPU);
 * - then the bias (float32) and one rounding to nearest even (`vcvtneps2bf16`).
 * Each output is one thread's, whatever the row count, the row's neighbours or the
 * thread count: a row's result is the same bits alone or in a batch.
 *
 * Weight layout (`pack` in cpu_linear.py): blocks of 32 outputs, zero-padded past N,
 * each [K / 2][32][2]: for pair i, the 32 outputs' two inputs side by side (128 bytes).
 * A thread sweeps a block once per 32 rows, in 4 KiB slices: the first group of 4 rows
 * reads a slice from memory while prefetching the next, the other groups read it from
 * L1 (16 rows over SmolLM2's weights: 0.75x the time of one pass per row group).
 */
#include <stdint.h>
#include <string.h>

#ifdef __AVX512BF16__
#include <immintrin.h>

#define BLOCK_N 32 /* outputs per weight block: two vectors of 16 float32 */
#define ROW_GROUP 4 /* rows whose accumulators share the registers in one pass */
#define SLICE 32 /* input pairs per slice of a block: 32 x 128 bytes = 4 KiB */
#define MAX_ROWS 32 /* rows per sweep over a block (their accumulators on the stack) */

static inline __m512 bias_vector(const uint16_t *bias, int64_t n, int64_t N) {
    if (bias == NULL || n >= N) return _mm512_setzero_ps();
    int64_t left = N - n < 16 ? N - n : 16;
    __mmask16 mask = (__mmask16)((1u << left) - 1u);
    __m256i b = _mm256_maskz_loadu_epi16(mask, bias + n);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

/* ROWS rows (a constant, 1..ROW_GROUP) of x over input pairs [s0, s1) of one block,
 * carrying on from their accumulators in `acc` (from zeros where `fresh`). The first row
 * group over a slice (`prefetch`) asks for the next slice's weights while it computes, so
 * they stream in from memory during this slice's products. */
static inline __attribute__((always_inline)) void slice_rows(
    const uint16_t *x, int64_t K, const uint16_t *block, int64_t s0, int64_t s1, int fresh,
    int prefetch, __m512 *acc, const int ROWS) {
    __m512 a[ROW_GROUP][2];
    for (int r = 0; r < ROWS; r++)
        for (int h = 0; h < 2; h++) a[r][h] = fresh ? _mm512_setzero_ps() : acc[2 * r + h];
    for (int64_t i = s0; i < s1; i++) {
        const uint16_t *w = block + i * 2 * BLOCK_N;
        if (prefetch) {
            _mm_prefetch((const char *)(w + SLICE * 2 * BLOCK_N), _MM_HINT_T0);
            _mm_prefetch((const char *)(w + SLICE * 2 * BLOCK_N + 32), _MM_HINT_T0);
        }
        const __m512i w0 = _mm512_loadu_si512((const void *)w);
        const __m512i w1 = _mm512_loadu_si512((const void *)(w + 32));
        for (int r = 0; r < ROWS; r++) {
            uint32_t pair;
            memcpy(&pair, x + r * K + 2 * i, sizeof pair);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)pair);
            a[r][0] = _mm512_dpbf16_ps(a[r][0], xb, (__m512bh)w0);
            a[r][1] = _mm512_dpbf16_ps(a[r][1], xb, (__m512bh)w1);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int h = 0; h < 2; h++) acc[2 * r + h] = a[r][h];
}

/* `rows` (1..MAX_ROWS) rows of x against one weight block; writes their 32 outputs. The
 * block is read slice by slice (SLICE pairs, 4 KiB): a slice comes from memory once and
 * serves every row group from L1. */
static void block_product(const uint16_t *x, int64_t rows, int64_t K, const uint16_t *block,
                          const uint16_t *bias, uint16_t *out, int64_t N, int64_t n0,
                          int64_t k_block) {
    __m512 acc[MAX_ROWS * 2], total[MAX_ROWS * 2];
    const int64_t pairs = K / 2, chunk = k_block / 2;
    for (int64_t p0 = 0; p0 < pairs; p0 += chunk) { /* oneDNN's K chunks */
        const int64_t p1 = p0 + chunk < pairs ? p0 + chunk : pairs;
        for (int64_t s0 = p0; s0 < p1; s0 += SLICE) {
            const int64_t s1 = s0 + SLICE < p1 ? s0 + SLICE : p1;
            for (int64_t m0 = 0; m0 < rows; m0 += ROW_GROUP) {
                const uint16_t *xr = x + m0 * K;
                __m512 *a = acc + 2 * m0;
                const int fresh = s0 == p0, first = m0 == 0;
                switch (rows - m0 < ROW_GROUP ? rows - m0 : ROW_GROUP) {
                case 1: slice_rows(xr, K, block, s0, s1, fresh, first, a, 1); break;
                case 2: slice_rows(xr, K, block, s0, s1, fresh, first, a, 2); break;
                case 3: slice_rows(xr, K, block, s0, s1, fresh, first, a, 3); break;
                default: slice_rows(xr, K, block, s0, s1, fresh, first, a, 4); break;
                }
            }
        }
        for (int64_t j = 0; j < 2 * rows; j++)
            total[j] = p0 == 0 ? acc[j] : _mm512_add_ps(total[j], acc[j]);
    }
    for (int h = 0; h < 2; h++) {
        const int64_t n = n0 + 16 * h;
        if (n >= N) break;
        const int64_t left = N - n < 16 ? N - n : 16;
        const __mmask16 mask = (__mmask16)((1u << left) - 1u);
        const __m512 b = bias_vector(bias, n, N);
        for (int64_t r = 0; r < rows; r++) {
            const __m512 t = total[2 * r + h];
            const __m512 sum = bias == NULL ? t : _mm512_add_ps(t, b);
            const __m256bh rounded = _mm512_cvtneps_pbh(sum);
            _mm256_mask_storeu_epi16(out + r * N + n, mask, (__m256i)rounded);
        }
    }
}

int bf16_linear_available(void) { return 1; }

/* out [M, N] = x [M, K] @ w.T (+ bias [N]); w packed as above; K even. */
void bf16_linear(const uint16_t *x, int64_t M, int64_t K, const uint16_t *w, int64_t N,
                 const uint16_t *bias, uint16_t *out, int64_t k_block, int num_threads) {
    const int64_t num_blocks = (N + BLOCK_N - 1) / BLOCK_N;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint16_t *block = w + b * K * BLOCK_N;
        for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
            const int64_t rows = M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS;
            block_product(x + m0 * K, rows, K, block, bias, out + m0 * N, N, b * BLOCK_N,
                          k_block);
        }
    }
}

#else /* no AVX-512 BF16: the Python side sees `bf16_linear_available() == 0` */

int bf16_linear_available(void) { return 0; }

void bf16_linear(const uint16_t *x, int64_t M, int64_t K, const uint16_t *w, int64_t N,
                 const uint16_t *bias, uint16_t *out, int64_t k_block, int num_threads) {
    (void)x; (void)M; (void)K; (void)w; (void)N; (void)bias; (void)out; (void)k_block;
    (void)num_threads;
}

#endif
