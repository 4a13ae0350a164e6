/* Paged attention on a CPU, every query row in one fixed order of operations.
 *
 * `cluster/kernels/cpu_attention.py` builds this file (gcc -O3 -march=native
 * -ffp-contract=off, OpenMP) and calls `paged_attention_pieces`; the torch reference is
 * `paged_attention_ref` in `paged_attention.py`.
 *
 * A work item is a piece (up to 16 consecutive new tokens of one sequence), one KV head
 * and a chunk of at most `row_chunk` of its rows (the piece's queries of that head's
 * query heads; the caller sizes chunks so that one verification piece still spreads over
 * the threads). An item reads its keys and values from the cache once, block by block,
 * as float32 rows. Each row's result is
 * the same bits whatever else the item or the step holds, so a token's attention is the
 * same alone, in a batch, in a verification step, in a prefill chunk or as a draft-tree
 * node whose ancestors sit among masked siblings (batch invariance):
 * - a score is q.k in 16 lanes (lane l sums dims l, l + 16, ... in order) added in a
 *   fixed tree (16 keys' trees at once, as vector shuffles), times `scale`;
 * - keys the row may not see (later positions, tree bits) get a weight of exactly 0;
 *   the row's max is order-free; weights are exp(score - max) by the polynomial below,
 *   the same in vector lanes and scalar tails (no contraction to FMA, no reassociation);
 * - the weighted sum of values and the sum of weights run key by key in key order,
 *   skipping zero weights (adding them would change nothing), and divide once.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define KEY_BLOCK 16
#define MAX_TREE_TOKENS 64
#define PIECE_LEN_MAX 16 /* queries per piece (attention_plan.PIECE_LEN) */

enum { DTYPE_FLOAT32 = 0, DTYPE_BFLOAT16 = 1 };

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* `n` values of `dtype` at `src` as float32 in `dst`. */
static inline void load_row(float *restrict dst, const void *src, int dtype, int n) {
    if (dtype == DTYPE_BFLOAT16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int i = 0; i < n; i++) dst[i] = bf16_to_float(s[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

/* exp(x) for x <= 0 (a score minus its row's max): 2^n * p(r), r = x - n ln2, with a
 * degree-6 polynomial for p (relative error ~2e-7); 0 below -87 (and for -inf). */
static inline float exp_nonpositive(float x) {
    const float log2e = 1.44269504088896341f;
    const float ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    float clamped = x < -87.0f ? -87.0f : x;
    float n = (clamped * log2e + 12582912.0f) - 12582912.0f; /* round to nearest */
    float r = clamped - n * ln2_hi;
    r = r - n * ln2_lo;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.0f ? 0.0f : p * scale;
}

typedef float v16 __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

/* q . k for the N rows q, q + dim, ... against one key k (`dim` a multiple of 16), before
 * the lanes are added: lane l sums dims l, l + 16, ... in order. Into out[0],
 * out[KEY_BLOCK], ...; the rows' chains interleaved (N a constant, 1 to 4). */
static inline __attribute__((always_inline)) void dot_rows(const float *q, const float *k,
                                                           int dim, v16 *out, const int N) {
    v16 acc[4] = {{0}, {0}, {0}, {0}}, x, y;
    for (int d = 0; d < dim; d += 16) {
        memcpy(&x, k + d, sizeof x);
        for (int i = 0; i < N; i++) {
            memcpy(&y, q + i * dim + d, sizeof y);
            acc[i] += y * x;
        }
    }
    for (int i = 0; i < N; i++) out[i * KEY_BLOCK] = acc[i];
}

static inline __attribute__((always_inline)) void dot_rows_any(const float *q, const float *k,
                                                               int dim, v16 *out, int n) {
    switch (n) {
    case 1: dot_rows(q, k, dim, out, 1); break;
    case 2: dot_rows(q, k, dim, out, 2); break;
    case 3: dot_rows(q, k, dim, out, 3); break;
    default: dot_rows(q, k, dim, out, 4); break;
    }
}

/* The 16 lane sums of 16 keys' `dot_rows` at once, each in the same fixed tree:
 * s8[i] = l[i] + l[i + 8]; s4[i] = s8[i] + s8[i + 4]; (s4[0] + s4[2]) + (s4[1] + s4[3]).
 * Lane c of the result is key c's sum. */
static inline v16 sum_lanes16(const v16 *a) {
    v16 b[8], c[4], d[2];
    for (int m = 0; m < 8; m++)
        b[m] = __builtin_shufflevector(a[2 * m], a[2 * m + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17,
                                       18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(a[2 * m], a[2 * m + 1], 8, 9, 10, 11, 12, 13, 14, 15,
                                       24, 25, 26, 27, 28, 29, 30, 31);
    for (int n = 0; n < 4; n++)
        c[n] = __builtin_shufflevector(b[2 * n], b[2 * n + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16,
                                       17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(b[2 * n], b[2 * n + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20,
                                       21, 22, 23, 28, 29, 30, 31);
    for (int p = 0; p < 2; p++)
        d[p] = __builtin_shufflevector(c[2 * p], c[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16,
                                       17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(c[2 * p], c[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18,
                                       19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24,
                                   26, 28, 30) +
           __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25,
                                   27, 29, 31);
}

typedef struct {
    const char *q;
    int64_t q_token_stride, q_head_stride; /* bytes */
    int q_dtype;
    const char *k_cache, *v_cache;
    int cache_dtype;
    int num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    char *out;
    int out_dtype;
} Layer;

/* Keys ahead whose cache rows are prefetched: a row is a few cache lines at a scattered
 * slot, and loading them one key at a time left the kernel waiting on memory. */
#define PREFETCH_KEYS 8

static inline void prefetch_row(const char *row, int64_t row_bytes) {
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b, 0, 3);
}

/* The weighted values of rows [0, rows) over keys [0, num_keys) (`vf`: the item's values
 * as float32, [num_keys, dim]), key by key in key order, skipping zero weights:
 * acc[r] += w * v, total[r] += w. ROWS rows and DV vectors of 16 per row are compile-time
 * constants here, so the accumulators stay in registers; `values_rows_any` does the same
 * arithmetic in memory for other shapes. */
static inline __attribute__((always_inline)) void values_rows_fixed(
    const float *vf, int num_keys, const float *weights, int padded, float *acc_out,
    float *total_out, const int ROWS, const int DV) {
    const int dim = DV * 16;
    v16 acc[4][8];
    float total[4];
    for (int r = 0; r < ROWS; r++) {
        total[r] = 0.0f;
        for (int v = 0; v < DV; v++) acc[r][v] = (v16){0};
    }
    for (int c = 0; c < num_keys; c++) {
        const float *row = vf + (size_t)c * dim;
        for (int r = 0; r < ROWS; r++) {
            const float w = weights[(size_t)r * padded + c];
            if (w == 0.0f) continue;
            for (int v = 0; v < DV; v++) {
                v16 x;
                memcpy(&x, row + 16 * v, sizeof x);
                acc[r][v] += w * x;
            }
            total[r] += w;
        }
    }
    for (int r = 0; r < ROWS; r++) {
        total_out[r] = total[r];
        for (int v = 0; v < DV; v++) memcpy(acc_out + (size_t)r * dim + 16 * v, &acc[r][v], 64);
    }
}

static void values_rows_any(const float *vf, int dim, int num_keys, const float *weights,
                            int padded, float *acc, float *total, int rows) {
    memset(acc, 0, (size_t)rows * dim * sizeof(float));
    memset(total, 0, (size_t)rows * sizeof(float));
    for (int c = 0; c < num_keys; c++) {
        const float *row = vf + (size_t)c * dim;
        for (int r = 0; r < rows; r++) {
            float w = weights[(size_t)r * padded + c];
            if (w == 0.0f) continue;
            float *a = acc + (size_t)r * dim;
            for (int d = 0; d < dim; d++) a[d] += w * row[d];
            total[r] += w;
        }
    }
}

/* Rows per group of `values_rows_fixed` for a head size (vectors of 16 per row): 16
 * accumulator registers at most. */
static inline int value_group(int dv) { return dv == 4 ? 4 : dv == 8 ? 2 : 0; }

static void values_rows(const float *vf, int dim, int num_keys, const float *weights,
                        int padded, float *acc, float *total, int rows) {
    const int dv = dim / 16, group = value_group(dv);
    if (group == 0) {
        values_rows_any(vf, dim, num_keys, weights, padded, acc, total, rows);
        return;
    }
    for (int r0 = 0; r0 < rows; r0 += group) {
        const int n = rows - r0 < group ? rows - r0 : group;
        const float *w = weights + (size_t)r0 * padded;
        float *a = acc + (size_t)r0 * dim, *t = total + r0;
#define VALUES(ROWS, DV) values_rows_fixed(vf, num_keys, w, padded, a, t, ROWS, DV)
        if (dv == 4) {
            switch (n) {
            case 1: VALUES(1, 4); break;
            case 2: VALUES(2, 4); break;
            case 3: VALUES(3, 4); break;
            default: VALUES(4, 4); break;
            }
        } else {
            if (n == 1) VALUES(1, 8);
            else VALUES(2, 8);
        }
#undef VALUES
    }
}

/* The item's keys and values [0, num_keys) as float32 rows of `dim` in kf and vf, read
 * from their cache slots block by block (no division per key), rows prefetched a few
 * keys ahead. */
static void gather_kv(const Layer *L, const int32_t *blocks, int kvh, int num_keys,
                      float *kf, float *vf) {
    const int dim = L->head_dim, bs = L->block_size;
    const size_t cache_item = L->cache_dtype == DTYPE_BFLOAT16 ? 2 : 4;
    const int64_t row_bytes = dim * cache_item, slot_bytes = L->num_kv_heads * row_bytes;
    const int64_t head_offset = kvh * row_bytes;
    for (int c0 = 0; c0 < num_keys; c0 += bs) {
        const int n = num_keys - c0 < bs ? num_keys - c0 : bs;
        const int64_t base = (int64_t)blocks[c0 / bs] * bs * slot_bytes + head_offset;
        if (c0 + bs < num_keys) { /* the next block's rows */
            const int64_t next = (int64_t)blocks[c0 / bs + 1] * bs * slot_bytes + head_offset;
            const int m = num_keys - c0 - bs < PREFETCH_KEYS ? num_keys - c0 - bs : PREFETCH_KEYS;
            for (int i = 0; i < m; i++) {
                prefetch_row(L->k_cache + next + i * slot_bytes, row_bytes);
                prefetch_row(L->v_cache + next + i * slot_bytes, row_bytes);
            }
        }
        for (int i = 0; i < n; i++) {
            if (i + PREFETCH_KEYS < n) {
                prefetch_row(L->k_cache + base + (i + PREFETCH_KEYS) * slot_bytes, row_bytes);
                prefetch_row(L->v_cache + base + (i + PREFETCH_KEYS) * slot_bytes, row_bytes);
            }
            const int64_t at = base + i * slot_bytes;
            load_row(kf + (size_t)(c0 + i) * dim, L->k_cache + at, L->cache_dtype, dim);
            load_row(vf + (size_t)(c0 + i) * dim, L->v_cache + at, L->cache_dtype, dim);
        }
    }
}

/* The largest of x[0..n) (-inf for none): in 16 lanes, then across them; a maximum does
 * not depend on the order it is taken in. */
static inline float row_max(const float *x, int n) {
    v16 m = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY,
             -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY,
             -INFINITY, -INFINITY};
    int c = 0;
    for (; c + 16 <= n; c += 16) {
        v16 y;
        memcpy(&y, x + c, sizeof y);
        const v16u more = (v16u)(y > m); /* all ones where y is larger */
        m = (v16)(((v16u)y & more) | ((v16u)m & ~more));
    }
    float max = -INFINITY;
    for (int l = 0; l < 16; l++) max = m[l] > max ? m[l] : max;
    for (; c < n; c++) max = x[c] > max ? x[c] : max;
    return max;
}

/* One work item: rows [row0, row0 + num_rows) of a piece's rows for one KV head; rows
 * are (query j, head g) as j * group + g. `scratch` holds
 * rows * (16 * KEY_BLOCK + 2 * head_dim + padded_keys + 1) + 2 * padded_keys * head_dim
 * floats, 64-byte aligned (the Python side rounds each thread's share up to 16 floats).
 * A row's arithmetic does not depend on which item or which other rows it shares an item
 * with. */
static void attend_rows(const Layer *L, const int32_t *blocks, int first_token, int first_pos,
                        int tree_start, const int64_t *tree_bits, int kvh, int row0,
                        int num_rows, float *scratch) {
    const int group = L->num_heads / L->num_kv_heads, dim = L->head_dim;
    const int rows = num_rows;
    const int last_query = (row0 + rows - 1) / group;
    const int num_keys = first_pos + last_query + 1; /* the last query sees them all */
    const int padded = (num_keys + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
    v16 *lanes = (v16 *)scratch; /* [rows, KEY_BLOCK]: scratch is 64-byte aligned */
    float *qf = scratch + (size_t)rows * KEY_BLOCK * 16; /* [rows, dim] */
    float *acc = qf + (size_t)rows * dim;         /* [rows, dim] */
    float *weights = acc + (size_t)rows * dim;    /* [rows, padded] */
    float *total = weights + (size_t)rows * padded; /* [rows] */
    float *kf = total + rows;                     /* [num_keys, dim] the keys as float32 */
    float *vf = kf + (size_t)padded * dim;        /* [num_keys, dim] the values */
    for (int i = 0; i < rows; i++) {
        const int j = (row0 + i) / group, g = (row0 + i) % group;
        const char *src = L->q + (int64_t)(first_token + j) * L->q_token_stride +
                          (int64_t)(kvh * group + g) * L->q_head_stride;
        load_row(qf + (size_t)i * dim, src, L->q_dtype, dim);
    }
    gather_kv(L, blocks, kvh, num_keys, kf, vf);
    /* scores: weights[r, c] = scale * q[r] . k[c], lanes summed 16 keys at a time
     * (keys past num_keys score 0 here and are masked below) */
    for (int c0 = 0; c0 < num_keys; c0 += KEY_BLOCK) {
        const int n = num_keys - c0 < KEY_BLOCK ? num_keys - c0 : KEY_BLOCK;
        for (int c = c0; c < c0 + n; c++) {
            const float *row = kf + (size_t)c * dim;
            for (int r = 0; r < rows; r += 4) { /* up to four rows' chains at once */
                const float *qr = qf + (size_t)r * dim;
                v16 *out = lanes + r * KEY_BLOCK + (c - c0);
                const int n_rows = rows - r < 4 ? rows - r : 4;
                /* common head sizes as constants, so the loop over dims unrolls */
                if (dim == 64) dot_rows_any(qr, row, 64, out, n_rows);
                else if (dim == 128) dot_rows_any(qr, row, 128, out, n_rows);
                else dot_rows_any(qr, row, dim, out, n_rows);
            }
        }
        for (int r = 0; r < rows; r++) {
            for (int c = n; c < KEY_BLOCK; c++) lanes[r * KEY_BLOCK + c] = (v16){0};
            v16 scores = sum_lanes16(lanes + r * KEY_BLOCK) * L->scale;
            memcpy(weights + (size_t)r * padded + c0, &scores, sizeof scores);
        }
    }
    /* weights: exp(score - max) over the keys each row sees, exactly 0 elsewhere */
    for (int i = 0; i < rows; i++) {
        const int j = (row0 + i) / group;
        const int64_t bits = tree_bits[first_token + j];
        const int seen = first_pos + j + 1; /* causal: keys up to the query itself */
        float *w = weights + (size_t)i * padded;
        if (bits == -1) { /* causal only: the keys past the query */
            for (int c = seen; c < padded; c++) w[c] = -INFINITY;
        } else {
            for (int c = 0; c < padded; c++) {
                int m = c - tree_start;
                int visible = c < seen && (m < 0 || (m < MAX_TREE_TOKENS && ((bits >> m) & 1)));
                w[c] = visible ? w[c] : -INFINITY;
            }
        }
        float max = row_max(w, seen);
        for (int c = 0; c < padded; c++) w[c] = exp_nonpositive(w[c] - max);
    }
    /* values, key by key in key order */
    values_rows(vf, dim, num_keys, weights, padded, acc, total, rows);
    const size_t out_item = L->out_dtype == DTYPE_BFLOAT16 ? 2 : 4;
    for (int i = 0; i < rows; i++) {
        const int j = (row0 + i) / group, g = (row0 + i) % group;
        char *dst = L->out + ((int64_t)(first_token + j) * L->num_heads + kvh * group + g) *
                                 dim * out_item;
        const float *a = acc + (size_t)i * dim;
        if (L->out_dtype == DTYPE_BFLOAT16) {
            uint16_t *o = (uint16_t *)dst;
            for (int d = 0; d < dim; d += 16) { /* to nearest even, as torch; NaN stays NaN */
                v16 x;
                memcpy(&x, a + d, sizeof x);
                x = x / total[i];
                v16u bits, lsb, nan;
                memcpy(&bits, &x, sizeof bits);
                lsb = (bits >> 16) & 1u;
                nan = (bits & 0x7fffffffu) > 0x7f800000u; /* all ones where NaN */
                bits = ((bits + 0x7fffu + lsb) & ~nan) | ((bits | 0x400000u) & nan);
                for (int l = 0; l < 16; l++) o[d + l] = (uint16_t)(bits[l] >> 16);
            }
        } else {
            for (int d = 0; d < dim; d++) ((float *)dst)[d] = a[d] / total[i];
        }
    }
}

/* This step's keys and values into their cache slots: k, v [num_tokens, num_kv_heads,
 * head_dim] with token and head strides in bytes (head_dim contiguous), in the cache's
 * dtype; slots [num_tokens] int64, each in [0, num_slots) (else nothing is written and
 * the result is -1). */
int write_kv_slots(const char *k, int64_t k_token_stride, int64_t k_head_stride,
                   const char *v, int64_t v_token_stride, int64_t v_head_stride,
                   char *k_cache, char *v_cache, const int64_t *slots, int64_t num_tokens,
                   int64_t num_slots, int num_kv_heads, int64_t row_bytes) {
    for (int64_t t = 0; t < num_tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    for (int64_t t = 0; t < num_tokens; t++)
        for (int h = 0; h < num_kv_heads; h++) {
            const int64_t dst = (slots[t] * num_kv_heads + h) * row_bytes;
            memcpy(k_cache + dst, k + t * k_token_stride + h * k_head_stride, row_bytes);
            memcpy(v_cache + dst, v + t * v_token_stride + h * v_head_stride, row_bytes);
        }
    return 0;
}

/* Attention for a step's query tokens, cut into pieces.
 * q: [num_tokens, heads, head_dim] (strides in bytes; head_dim contiguous);
 * k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous;
 * block_tables: [num_seqs, table_stride] int32;
 * per piece (int32): its sequence, first token row, query count, first query's
 * position, and the first key its tree bits describe;
 * tree_bits: [num_tokens] int64, keys from the piece's tree start on are visible only
 * where their bit (key - tree start) is set (-1: all);
 * out: [num_tokens, heads, head_dim], contiguous, of out_dtype;
 * row_chunk: rows per work item at most;
 * scratch: `scratch_floats` floats per thread; num_threads: OpenMP threads. */
void paged_attention_pieces(
    const void *q, int64_t q_token_stride, int64_t q_head_stride, int q_dtype,
    const void *k_cache, const void *v_cache, int cache_dtype, const int32_t *block_tables,
    int64_t table_stride, const int32_t *piece_seq, const int32_t *piece_token,
    const int32_t *piece_queries, const int32_t *piece_first_pos,
    const int32_t *piece_tree_start, const int64_t *tree_bits, int num_pieces,
    int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, void *out,
    int out_dtype, int row_chunk, float *scratch, int64_t scratch_floats, int num_threads) {
    const Layer layer = {(const char *)q, q_token_stride, q_head_stride, q_dtype,
                         (const char *)k_cache, (const char *)v_cache, cache_dtype,
                         num_heads, num_kv_heads, head_dim, block_size, scale,
                         (char *)out, out_dtype};
    /* A work item: a piece, a KV head and a chunk of at most row_chunk of its rows. */
    const int group = num_heads / num_kv_heads;
    const int chunks = (PIECE_LEN_MAX * group + row_chunk - 1) / row_chunk;
    const int64_t items = (int64_t)num_pieces * num_kv_heads * chunks;
    /* Many pieces (a decode batch): a thread takes a whole piece at a time, all its KV
     * heads' rows from the same cache lines; few: item by item, to spread them. */
    const int grain = num_pieces >= 4 * num_threads ? num_kv_heads * chunks : 1;
#pragma omp parallel for schedule(dynamic, grain) num_threads(num_threads)
    for (int64_t item = 0; item < items; item++) {
        int thread = 0;
#ifdef _OPENMP
        extern int omp_get_thread_num(void);
        thread = omp_get_thread_num();
#endif
        const int chunk = (int)(item % chunks);
        const int64_t head_item = item / chunks;
        const int p = (int)(head_item / num_kv_heads), kvh = (int)(head_item % num_kv_heads);
        const int rows = piece_queries[p] * group, row0 = chunk * row_chunk;
        if (row0 >= rows) continue;
        attend_rows(&layer, block_tables + (int64_t)piece_seq[p] * table_stride,
                    piece_token[p], piece_first_pos[p], piece_tree_start[p], tree_bits, kvh,
                    row0, rows - row0 < row_chunk ? rows - row0 : row_chunk,
                    scratch + thread * scratch_floats);
    }
}
