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
 * reads a slice while prefetching the one two slices on into L2, the other groups read it
 * from L1 (16 rows over SmolLM2's weights: 0.75x the time of one pass per row group).
 * Prefetching into L2 rather than L1 keeps L1's few outstanding misses for the loads
 * themselves: over SmolLM2's layers (AMD EPYC Zen 4) 16 rows took 0.70x the time of a
 * prefetch into L1 one slice on, 4 rows 0.75x, one row 0.83-0.98x; the AVX2 build on the
 * same CPU 0.87x at one row.
 */
#include <stdint.h>
#include <string.h>

#define BLOCK_N 32 /* outputs per weight block */
#define ROW_GROUP 4 /* rows whose accumulators share the registers in one pass (AVX2: their
                     * 16 vectors fill the registers; 2 rows took 1.3-1.4x the time at 16) */
#define SLICE 32 /* input pairs per slice of a block: 32 x 128 bytes = 4 KiB */
#define MAX_ROWS 32 /* rows per sweep over a block (their accumulators on the stack) */
/* weights (elements) between a pair being read and the one being prefetched (into L2) */
#define PREFETCH_AHEAD (2 * SLICE * 2 * BLOCK_N)

/* Each instruction set below defines `acc_t` (a vector of float32 accumulators),
 * ACC_PER_ROW (vectors per row of a block's 32 outputs), `acc_add`, `slice_rows` (a row
 * group's products over a slice) and `store_outputs` (bias, rounding, store); the sweep
 * over a block (`block_product`) and the threads' split (`bf16_linear`) are shared. */

#ifdef __AVX512BF16__
#include <immintrin.h>

typedef __m512 acc_t; /* 16 float32 */
#define ACC_PER_ROW 2

static inline acc_t acc_add(acc_t a, acc_t b) { return _mm512_add_ps(a, b); }

static inline __m512 bias_vector(const uint16_t *bias, int64_t n, int64_t N) {
    if (bias == NULL || n >= N) return _mm512_setzero_ps();
    int64_t left = N - n < 16 ? N - n : 16;
    __mmask16 mask = (__mmask16)((1u << left) - 1u);
    __m256i b = _mm256_maskz_loadu_epi16(mask, bias + n);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

/* ROWS rows (a constant, 1..ROW_GROUP) of x over input pairs [s0, s1) of one block,
 * carrying on from their accumulators in `acc` (from zeros where `fresh`). The first row
 * group over a slice (`prefetch`) asks for the weights two slices on while it computes, so
 * they stream in from memory during this and the next slice's products. */
static inline __attribute__((always_inline)) void slice_rows(
    const uint16_t *x, int64_t K, const uint16_t *block, int64_t s0, int64_t s1, int fresh,
    int prefetch, acc_t *acc, const int ROWS) {
    __m512 a[ROW_GROUP][2];
    for (int r = 0; r < ROWS; r++)
        for (int h = 0; h < 2; h++) a[r][h] = fresh ? _mm512_setzero_ps() : acc[2 * r + h];
    for (int64_t i = s0; i < s1; i++) {
        const uint16_t *w = block + i * 2 * BLOCK_N;
        if (prefetch) {
            _mm_prefetch((const char *)(w + PREFETCH_AHEAD), _MM_HINT_T1);
            _mm_prefetch((const char *)(w + PREFETCH_AHEAD + 32), _MM_HINT_T1);
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

/* The 32 outputs of `rows` rows from their sums `total` (ACC_PER_ROW vectors a row): the
 * bias added, rounded to bfloat16 (`vcvtneps2bf16`), outputs past N left out. */
static inline void store_outputs(const acc_t *total, int64_t rows, const uint16_t *bias,
                                 uint16_t *out, int64_t N, int64_t n0) {
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

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* AVX2 with FMA and no bfloat16 instructions (AMD Zen 3, Intel before Cooper Lake): the
 * same arithmetic as `vdpbf16ps`, so the same bits as the AVX-512 BF16 kernel above. A
 * product of two bfloat16 values is exact in float32, so `fma(x, w, acc)` rounds once,
 * as `vdpbf16ps` does each add; the odd input of a pair goes first. (`vdpbf16ps` also
 * flushes sums below float32's normal range, about 1e-38, to zero; here they stay.)
 * Weights are read as bfloat16, half the bytes of float32: a bfloat16 engine on such a
 * CPU reads its weights at two bytes each and computes in float32. */

typedef __m256 acc_t; /* 8 float32 */
#define ACC_PER_ROW 4

static inline acc_t acc_add(acc_t a, acc_t b) { return _mm256_add_ps(a, b); }

/* ROWS rows (1..ROW_GROUP) of x over input pairs [s0, s1) of one block; see the AVX-512
 * `slice_rows` above. A 32-byte load holds 8 outputs' pairs: the high halves of its
 * 32-bit lanes are the odd inputs' weights as float32, the low halves shifted up the even. */
static inline __attribute__((always_inline)) void slice_rows(
    const uint16_t *x, int64_t K, const uint16_t *block, int64_t s0, int64_t s1, int fresh,
    int prefetch, acc_t *acc, const int ROWS) {
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 a[ROW_GROUP][4];
    for (int r = 0; r < ROWS; r++)
        for (int v = 0; v < 4; v++) a[r][v] = fresh ? _mm256_setzero_ps() : acc[4 * r + v];
    for (int64_t i = s0; i < s1; i++) {
        const uint16_t *w = block + i * 2 * BLOCK_N;
        if (prefetch) {
            _mm_prefetch((const char *)(w + PREFETCH_AHEAD), _MM_HINT_T1);
            _mm_prefetch((const char *)(w + PREFETCH_AHEAD + 32), _MM_HINT_T1);
        }
        __m256 xo[ROW_GROUP], xe[ROW_GROUP];
        for (int r = 0; r < ROWS; r++) {
            uint32_t pair;
            memcpy(&pair, x + r * K + 2 * i, sizeof pair);
            const __m256i p = _mm256_set1_epi32((int)pair);
            xo[r] = _mm256_castsi256_ps(_mm256_and_si256(p, high));
            xe[r] = _mm256_castsi256_ps(_mm256_slli_epi32(p, 16));
        }
        for (int v = 0; v < 4; v++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + 16 * v));
            const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(wv, high));
            const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));
            for (int r = 0; r < ROWS; r++) {
                a[r][v] = _mm256_fmadd_ps(xo[r], wo, a[r][v]);
                a[r][v] = _mm256_fmadd_ps(xe[r], we, a[r][v]);
            }
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int v = 0; v < 4; v++) acc[4 * r + v] = a[r][v];
}

/* 8 float32 to bfloat16 as `vcvtneps2bf16` rounds: nearest even, inputs below the normal
 * range as zero, NaN quiet. */
static inline __m128i to_bf16(__m256 value) {
    const __m256i bits = _mm256_castps_si256(value);
    const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32((int)0x80000000u));
    const __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF));
    const __m256i subnormal = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x00800000), magnitude);
    const __m256i nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7F800000));
    const __m256i flushed = _mm256_blendv_epi8(bits, sign, subnormal);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(flushed, 16), _mm256_set1_epi32(1));
    const __m256i rounded =
        _mm256_add_epi32(flushed, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
    const __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x00400000));
    const __m256i high = _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quiet, nan), 16);
    const __m256i packed = _mm256_packus_epi32(high, high); /* per 128-bit lane */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

/* As the AVX-512 `store_outputs`: bias, rounding as `vcvtneps2bf16`, outputs past N out. */
static inline void store_outputs(const acc_t *total, int64_t rows, const uint16_t *bias,
                                 uint16_t *out, int64_t N, int64_t n0) {
    for (int v = 0; v < 4; v++) {
        const int64_t n = n0 + 8 * v;
        if (n >= N) break;
        const int64_t left = N - n < 8 ? N - n : 8;
        float b[8] = {0};
        if (bias != NULL)
            for (int64_t j = 0; j < left; j++) {
                const uint32_t bits = (uint32_t)bias[n + j] << 16;
                memcpy(&b[j], &bits, sizeof bits);
            }
        const __m256 bv = _mm256_loadu_ps(b);
        for (int64_t r = 0; r < rows; r++) {
            const __m256 t = total[4 * r + v];
            const __m128i rounded = to_bf16(bias == NULL ? t : _mm256_add_ps(t, bv));
            if (left == 8) {
                _mm_storeu_si128((__m128i *)(out + r * N + n), rounded);
            } else {
                uint16_t lanes[8];
                _mm_storeu_si128((__m128i *)lanes, rounded);
                memcpy(out + r * N + n, lanes, (size_t)left * sizeof lanes[0]);
            }
        }
    }
}

#endif

#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))

/* `rows` (1..MAX_ROWS) rows of x against one weight block; writes their 32 outputs. The
 * block is read slice by slice (SLICE pairs, 4 KiB): a slice comes from memory once and
 * serves every row group from L1. */
static void block_product(const uint16_t *x, int64_t rows, int64_t K, const uint16_t *block,
                          const uint16_t *bias, uint16_t *out, int64_t N, int64_t n0,
                          int64_t k_block) {
    acc_t acc[MAX_ROWS * ACC_PER_ROW], total[MAX_ROWS * ACC_PER_ROW];
    const int64_t pairs = K / 2, chunk = k_block / 2;
    for (int64_t p0 = 0; p0 < pairs; p0 += chunk) { /* oneDNN's K chunks */
        const int64_t p1 = p0 + chunk < pairs ? p0 + chunk : pairs;
        for (int64_t s0 = p0; s0 < p1; s0 += SLICE) {
            const int64_t s1 = s0 + SLICE < p1 ? s0 + SLICE : p1;
            for (int64_t m0 = 0; m0 < rows; m0 += ROW_GROUP) {
                const uint16_t *xr = x + m0 * K;
                acc_t *a = acc + ACC_PER_ROW * m0;
                const int fresh = s0 == p0, first = m0 == 0;
                switch (rows - m0 < ROW_GROUP ? rows - m0 : ROW_GROUP) {
                case 1: slice_rows(xr, K, block, s0, s1, fresh, first, a, 1); break;
                case 2: slice_rows(xr, K, block, s0, s1, fresh, first, a, 2); break;
                case 3: slice_rows(xr, K, block, s0, s1, fresh, first, a, 3); break;
                default: slice_rows(xr, K, block, s0, s1, fresh, first, a, 4); break;
                }
            }
        }
        for (int64_t j = 0; j < ACC_PER_ROW * rows; j++)
            total[j] = p0 == 0 ? acc[j] : acc_add(total[j], acc[j]);
    }
    store_outputs(total, rows, bias, out, N, n0);
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

#else /* neither: the Python side sees `bf16_linear_available() == 0` */

int bf16_linear_available(void) { return 0; }

void bf16_linear(const uint16_t *x, int64_t M, int64_t K, const uint16_t *w, int64_t N,
                 const uint16_t *bias, uint16_t *out, int64_t k_block, int num_threads) {
    (void)x; (void)M; (void)K; (void)w; (void)N; (void)bias; (void)out; (void)k_block;
    (void)num_threads;
}

#endif
