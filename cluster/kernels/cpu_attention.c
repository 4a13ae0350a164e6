/* Paged attention on a CPU, every query row in one fixed order of operations.
 *
 * `cluster/kernels/cpu_attention.py` builds this file (gcc -O3 -march=native
 * -ffp-contract=off, OpenMP) and calls `paged_attention_pieces`; the torch reference is
 * `paged_attention_ref` in `paged_attention.py`.
 *
 * A work item is a piece (up to 16 consecutive new tokens of one sequence) and one KV
 * head: its rows are the pieces' queries of that head's query heads. Each row's result is
 * the same bits whatever else the item or the step holds, so a token's attention is the
 * same alone, in a batch, in a verification step, in a prefill chunk or as a draft-tree
 * node whose ancestors sit among masked siblings (batch invariance):
 * - a score is q.k in 16 lanes (lane l sums dims l, l + 16, ... in order) added in a
 *   fixed tree, times `scale`;
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

enum { DTYPE_FLOAT32 = 0, DTYPE_BFLOAT16 = 1 };

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as torch */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
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
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

/* q . k over `dim` (a multiple of 16) floats: lane l sums dims l, l + 16, ... in order,
 * then the lanes are added in a fixed tree. */
static inline float dot(const float *q, const float *k, int dim) {
    v16 acc = {0}, a, b;
    for (int d = 0; d < dim; d += 16) {
        memcpy(&a, q + d, sizeof a);
        memcpy(&b, k + d, sizeof b);
        acc += a * b;
    }
    v8 s8 = __builtin_shufflevector(acc, acc, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(acc, acc, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) +
            __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* The cache slot of key `pos` of a sequence with block table `blocks`. */
static inline int64_t slot_of(const int32_t *blocks, int pos, int block_size) {
    return (int64_t)blocks[pos / block_size] * block_size + pos % block_size;
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

/* One work item. Rows are (query j, head g) as j * group + g. `scratch` holds
 * rows * (2 * head_dim + padded_keys + 1) + head_dim floats. */
static void attend_piece(const Layer *L, const int32_t *blocks, int first_token,
                         int num_queries, int first_pos, int tree_start,
                         const int64_t *tree_bits, int kvh, float *scratch) {
    const int group = L->num_heads / L->num_kv_heads, dim = L->head_dim;
    const int rows = num_queries * group;
    const int num_keys = first_pos + num_queries; /* the last query sees them all */
    const int padded = (num_keys + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
    const size_t cache_item = L->cache_dtype == DTYPE_BFLOAT16 ? 2 : 4;
    float *qf = scratch;                          /* [rows, dim] */
    float *acc = qf + (size_t)rows * dim;         /* [rows, dim] */
    float *weights = acc + (size_t)rows * dim;    /* [rows, padded] */
    float *total = weights + (size_t)rows * padded; /* [rows] */
    float *row = total + rows;                    /* [dim] one key or value */
    for (int j = 0; j < num_queries; j++)
        for (int g = 0; g < group; g++) {
            const char *src = L->q + (int64_t)(first_token + j) * L->q_token_stride +
                              (int64_t)(kvh * group + g) * L->q_head_stride;
            load_row(qf + (size_t)(j * group + g) * dim, src, L->q_dtype, dim);
        }
    /* scores: weights[r, c] = scale * q[r] . k[c] */
    for (int c = 0; c < num_keys; c++) {
        int64_t slot = slot_of(blocks, c, L->block_size);
        load_row(row, L->k_cache + (slot * L->num_kv_heads + kvh) * dim * cache_item,
                 L->cache_dtype, dim);
        for (int r = 0; r < rows; r++)
            weights[(size_t)r * padded + c] = dot(qf + (size_t)r * dim, row, dim) * L->scale;
    }
    /* weights: exp(score - max) over the keys each row sees, exactly 0 elsewhere */
    for (int j = 0; j < num_queries; j++) {
        const int64_t bits = tree_bits[first_token + j];
        const int seen = first_pos + j + 1; /* causal: keys up to the query itself */
        for (int g = 0; g < group; g++) {
            float *w = weights + (size_t)(j * group + g) * padded;
            for (int c = 0; c < padded; c++) {
                int m = c - tree_start;
                int visible = c < seen && (bits == -1 || m < 0 ||
                                           (m < MAX_TREE_TOKENS && ((bits >> m) & 1)));
                w[c] = visible ? w[c] : -INFINITY;
            }
            float max = -INFINITY;
            for (int c = 0; c < seen; c++) max = w[c] > max ? w[c] : max;
            for (int c = 0; c < padded; c++) w[c] = exp_nonpositive(w[c] - max);
        }
    }
    /* values, key by key in key order */
    memset(acc, 0, (size_t)rows * dim * sizeof(float));
    memset(total, 0, (size_t)rows * sizeof(float));
    for (int c = 0; c < num_keys; c++) {
        int64_t slot = slot_of(blocks, c, L->block_size);
        load_row(row, L->v_cache + (slot * L->num_kv_heads + kvh) * dim * cache_item,
                 L->cache_dtype, dim);
        for (int r = 0; r < rows; r++) {
            float w = weights[(size_t)r * padded + c];
            if (w == 0.0f) continue;
            float *a = acc + (size_t)r * dim;
            for (int d = 0; d < dim; d++) a[d] += w * row[d];
            total[r] += w;
        }
    }
    const size_t out_item = L->out_dtype == DTYPE_BFLOAT16 ? 2 : 4;
    for (int r = 0; r < rows; r++) {
        int j = r / group, g = r % group;
        char *dst = L->out + ((int64_t)(first_token + j) * L->num_heads + kvh * group + g) *
                                 dim * out_item;
        const float *a = acc + (size_t)r * dim;
        for (int d = 0; d < dim; d++) {
            float o = a[d] / total[r];
            if (L->out_dtype == DTYPE_BFLOAT16)
                ((uint16_t *)dst)[d] = float_to_bf16(o);
            else
                ((float *)dst)[d] = o;
        }
    }
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
 * scratch: `scratch_floats` floats per thread; num_threads: OpenMP threads. */
void paged_attention_pieces(
    const void *q, int64_t q_token_stride, int64_t q_head_stride, int q_dtype,
    const void *k_cache, const void *v_cache, int cache_dtype, const int32_t *block_tables,
    int64_t table_stride, const int32_t *piece_seq, const int32_t *piece_token,
    const int32_t *piece_queries, const int32_t *piece_first_pos,
    const int32_t *piece_tree_start, const int64_t *tree_bits, int num_pieces,
    int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, void *out,
    int out_dtype, float *scratch, int64_t scratch_floats, int num_threads) {
    const Layer layer = {(const char *)q, q_token_stride, q_head_stride, q_dtype,
                         (const char *)k_cache, (const char *)v_cache, cache_dtype,
                         num_heads, num_kv_heads, head_dim, block_size, scale,
                         (char *)out, out_dtype};
    const int64_t items = (int64_t)num_pieces * num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < items; item++) {
        int thread = 0;
#ifdef _OPENMP
        extern int omp_get_thread_num(void);
        thread = omp_get_thread_num();
#endif
        int p = (int)(item / num_kv_heads), kvh = (int)(item % num_kv_heads);
        attend_piece(&layer, block_tables + (int64_t)piece_seq[p] * table_stride,
                     piece_token[p], piece_queries[p], piece_first_pos[p],
                     piece_tree_start[p], tree_bits, kvh, scratch + thread * scratch_floats);
    }
}
