// Paged decode attention on the CPU: one query token per sequence, attended over its cached
// K/V where they lie in the pool, in float32 from end to end, in one call per layer and step.
//
// Built at first use by kernels/cpu_decode.py (the C++ compiler of the machine, -O3
// -march=native -fopenmp; no headers but the C library's and OpenMP's) and called through
// ctypes, which releases the GIL. The torch path of the same step (kernels/torch_sdpa.py: a
// gather of the blocks, then four or five ops of a fixed cost each) reads the K/V twice and
// rounds the scores and probabilities to 16 bits; this reads each position's K and V row once,
// straight from its block, and keeps every intermediate in float32, rounding only the output.
//
// Each (sequence, query head) is computed the same way whatever else the step holds, so a
// stream decodes to the same bits alone or in a batch (the engine's batch invariance).
//
// Layouts (kernels/torch_ref.py): query (tokens, heads, D) with row stride q_row elements;
// caches (num_blocks, block_size, kvh, D); block tables int32 rows of table_row entries.
//
// Below the attention, the rest of a CPU token's small work, each a call where torch took a
// handful of ops: the int8 LM head's rows, the 16-bit RMSNorm and rotary embedding (rounded as
// transformers rounds them), the KV write.

#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

inline int omp_thread() {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

inline float load(const float* p) { return *p; }
inline float load(const uint16_t* p) {  // bfloat16 -> float32: the high half of the bits
    uint32_t u = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline void store(float* p, float f) { *p = f; }
inline void store(uint16_t* p, float f) {  // float32 -> bfloat16, to nearest, ties to even
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {  // a NaN stays a (quiet) NaN
        *p = (uint16_t)((u >> 16) | 0x40u);
        return;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    *p = (uint16_t)(u >> 16);
}

// e^x for x <= 0 (a score less its row's maximum), within 2 ulp of expf: Cephes' reduction to
// 2^n e^r, |r| <= ln2 / 2, and its degree-6 polynomial; written so the compiler vectorizes it.
inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;  // (e^-87 ~ 1.6e-38: the smallest normal float's order)
    float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

// 16 floats: one AVX-512 register, two AVX2 ones, four NEON ones (the compiler splits it).
typedef float f16v __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
constexpr int W = 16;  // positions per chunk, and lanes per vector

// A head's D values as D / W vectors of float in the kernel's order: float32 as they lie;
// bfloat16 read 32 at a time as 16 32-bit words, whose low halves (the even elements) and high
// halves (the odd ones) are each one shift or mask from float32. A dot product or a weighted sum
// taken in this order on both sides is the same sum; `store_head` puts the order back.
inline void load_head(const float* p, f16v* v, int n) {
    memcpy(v, p, sizeof(f16v) * n);
}
inline void load_head(const uint16_t* p, f16v* v, int n) {
    for (int i = 0; i < n; i += 2) {
        u32x16 w;
        memcpy(&w, p + i * W, sizeof w);
        u32x16 even = w << 16, odd = w & 0xffff0000u;
        memcpy(&v[i], &even, sizeof(f16v));
        memcpy(&v[i + 1], &odd, sizeof(f16v));
    }
}
inline void store_head(float* p, const f16v* v, int n) {
    memcpy(p, v, sizeof(f16v) * n);
}
inline void store_head(uint16_t* p, const f16v* v, int n) {
    for (int i = 0; i < n; i += 2)
        for (int k = 0; k < W; k++) {
            store(p + i * W + 2 * k, v[i][k]);
            store(p + i * W + 2 * k + 1, v[i + 1][k]);
        }
}

#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (i16v){__VA_ARGS__})
#endif

typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef int8_t i8x32 __attribute__((vector_size(32)));

// Vector c of a row of int8 weights in the order `load_head` gives the activations: as they
// lie for float32; for bfloat16, of each 32, the even elements then the odd ones.
inline f16v int8_head(const int8_t* w, int c, bool pairs) {
    i8x16 b;
    if (!pairs) {
        memcpy(&b, w + c * W, sizeof b);
    } else {
        i8x32 two;
        memcpy(&two, w + (c / 2) * 2 * W, sizeof two);
        if (c % 2 == 0)
            b = __builtin_shufflevector(two, two, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        else
            b = __builtin_shufflevector(two, two, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    }
    return __builtin_convertvector(__builtin_convertvector(b, i16v), f16v);
}

// Four levels of pairs: lanes of v[0..15] summed so that lane o of the result is the sum of
// v[o]'s lanes, in a fixed order (so the same bits whatever the call's other work).
inline f16v sum_lanes(f16v* v) {
    for (int i = 0; i < 8; i++)  // [a's 8 half sums | b's 8]
        v[i] = SHUFFLE(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               SHUFFLE(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)  // [a 4 | b 4 | c 4 | d 4]
        v[i] = SHUFFLE(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               SHUFFLE(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)  // [a 2 | b 2 | ... | h 2]
        v[i] = SHUFFLE(v[2 * i], v[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               SHUFFLE(v[2 * i], v[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SHUFFLE(v[0], v[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SHUFFLE(v[0], v[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// The largest of s[0..n), n >= 1, W lanes at a time (a scalar chain waits on each compare).
inline float max_of(const float* s, int n) {
    f16v m;
    int p = 0;
    if (n >= W) {
        memcpy(&m, s, sizeof m);
        for (p = W; p + W <= n; p += W) {
            f16v x;
            memcpy(&x, s + p, sizeof x);
            m = x > m ? x : m;
        }
    } else {
        for (int i = 0; i < W; i++) m[i] = s[0];
    }
    float best = m[0];
    for (int i = 1; i < W; i++) best = m[i] > best ? m[i] : best;
    for (; p < n; p++) best = s[p] > best ? s[p] : best;
    return best;
}

// Position p's row (every KV head's K or V) in the pool, walked in order without a division
// per position: `next` moves block by block through the sequence's table.
template <typename T>
struct Rows {
    const T* cache;
    const int32_t* table;
    int bs;
    size_t row;
    int block, offset;  // where `next` is

    Rows(const T* cache, const int32_t* table, int p, int bs, size_t row)
        : cache(cache), table(table), bs(bs), row(row), block(p / bs), offset(p % bs) {}
    const T* next() {
        const T* r = cache + ((size_t)table[block] * bs + offset) * row;
        if (++offset == bs) {
            offset = 0;
            block++;
        }
        return r;
    }
};

// The rows of positions [p, p + n) into the caches, ahead of their use.
template <typename T>
inline void prefetch(Rows<T> rows, int n) {
    for (int o = 0; o < n; o++) {
        const char* at = (const char*)rows.next();
        for (size_t b = 0; b < rows.row * sizeof(T); b += 64) __builtin_prefetch(at + b);
    }
}

// Positions per partial sum of the values: fixed, so the sums' order (and the result's bits)
// never depends on the threads or the batch.
constexpr int SPAN = 256;
// Sequences at least this long are attended by all the threads; shorter ones by one, where
// the threads' fork and barriers (a few us) would cost more than they save.
constexpr int PARALLEL_MIN = 256;

// Floats of one sequence's scratch: per query head its scaled query, its scores (padded to W
// positions) and its values' partial sums (one per SPAN), then the softmax sums' inverses.
template <int D>
inline size_t scratch_floats(int heads, int len) {
    const size_t padded = (len + W - 1) / W * W, spans = (len + SPAN - 1) / SPAN;
    return heads * (D + padded + spans * D) + (heads + W - 1) / W * W;
}

// One sequence's query (heads, D) over its first `len` cached positions -> out (heads, D).
// scratch: `scratch_floats` floats, 64-byte aligned.
template <typename T, int D>
void attend(const T* q, const T* kc, const T* vc, const int32_t* table, int len, int bs, int kvh, int heads,
            float scale, T* out, float* scratch, int threads) {
    static_assert(D % (2 * W) == 0, "head sizes are whole pairs of vectors");
    constexpr int C = D / W;  // vectors per head
    const int g = heads / kvh;  // query heads per KV head
    const size_t row = (size_t)kvh * D;  // one position's K (or V) of every KV head
    const int padded = (len + W - 1) / W * W, chunks = padded / W, spans = (len + SPAN - 1) / SPAN;
    f16v* qv = (f16v*)scratch;  // (heads, C): the query times the scale, in the kernel's order
    float* scores = (float*)(qv + (size_t)heads * C);  // (heads, padded)
    f16v* partial = (f16v*)(scores + (size_t)heads * padded);  // (spans, heads, C): the values' sums
    float* inv = (float*)(partial + (size_t)spans * heads * C);  // (heads,): one over each softmax's sum
    for (int j = 0; j < heads; j++) {
        load_head(q + (size_t)j * D, qv + (size_t)j * C, C);
        for (int c = 0; c < C; c++) qv[j * C + c] *= scale;
    }

#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        // Scores, W positions at a time: their K rows (read from their blocks) stay in the
        // cache while each query head takes its W dot products, summed across lanes together.
#pragma omp for schedule(static)
        for (int k = 0; k < chunks; k++) {
            const int p = k * W, n = len - p < W ? len - p : W;
            const T* rows[W];
            Rows<T> walk(kc, table, p, bs, row);
            for (int o = 0; o < n; o++) rows[o] = walk.next();
            if (p + W < len) prefetch(walk, len - p - W < W ? len - p - W : W);
            f16v part[W];
            for (int o = n; o < W; o++) part[o] = f16v{};
            for (int j = 0; j < heads; j++) {
                f16v qj[C];
                for (int c = 0; c < C; c++) qj[c] = qv[j * C + c];
                const size_t at = (size_t)(j / g) * D;
                for (int o = 0; o < n; o++) {
                    f16v kf[C];
                    load_head(rows[o] + at, kf, C);
                    f16v s = qj[0] * kf[0];
                    for (int c = 1; c < C; c++) s += qj[c] * kf[c];
                    part[o] = s;
                }
                f16v sums = sum_lanes(part);
                memcpy(scores + (size_t)j * padded + p, &sums, sizeof sums);
            }
        }
        // Softmax's numerators, each head's row less its maximum; the sums divide at the end.
#pragma omp for schedule(static)
        for (int j = 0; j < heads; j++) {
            float* s = scores + (size_t)j * padded;
            float m = max_of(s, len);
            float total = 0.0f;
            for (int p = 0; p < len; p++) {
                float e = exp_nonpositive(s[p] - m);
                s[p] = e;
                total += e;
            }
            inv[j] = 1.0f / total;
        }
        // Values, a SPAN of positions for one query head at a time, its sum in registers; the
        // span's V rows stay in the cache for the other query heads of the same KV head.
#pragma omp for schedule(static)
        for (int u = 0; u < spans * heads; u++) {
            const int j = u % heads, sp = u / heads, first = sp * SPAN;
            const int last = first + SPAN < len ? first + SPAN : len;
            const size_t at = (size_t)(j / g) * D;
            const float* w = scores + (size_t)j * padded;
            f16v sum[C] = {};
            Rows<T> walk(vc, table, first, bs, row);
            for (int p = first; p < last; p++) {
                f16v vf[C];
                load_head(walk.next() + at, vf, C);
                for (int c = 0; c < C; c++) sum[c] += w[p] * vf[c];
            }
            f16v* dst = partial + ((size_t)sp * heads + j) * C;
            for (int c = 0; c < C; c++) dst[c] = sum[c];
        }
        // The spans' sums in order, over the softmax's sum.
#pragma omp for schedule(static)
        for (int j = 0; j < heads; j++) {
            f16v a[C];
            for (int c = 0; c < C; c++) {
                a[c] = partial[(size_t)j * C + c];
                for (int sp = 1; sp < spans; sp++) a[c] += partial[((size_t)sp * heads + j) * C + c];
                a[c] *= inv[j];
            }
            store_head(out + (size_t)j * D, a, C);
        }
    }
}

// The rows: the long ones one after another, each by all the threads; then the short ones,
// spread over the threads a row at a time, each thread in its own slot of the scratch. A row's
// arithmetic is the same either way (the threads never split a sum differently).
template <typename T, int D>
void attend_all(const void* query, long q_row, const void* key_cache, const void* value_cache, const int32_t* tables,
                long table_row, const int32_t* rows, const int32_t* lens, int n, int bs, int kvh, int heads,
                float scale, void* output, long out_row, float* scratch, int threads) {
    const T* q = (const T*)query;
    T* out = (T*)output;
    int longest = 1;
    for (int s = 0; s < n; s++) longest = lens[s] > longest ? lens[s] : longest;
    const size_t slot = scratch_floats<D>(heads, longest);  // (a multiple of W floats: slots stay aligned)
    scratch = (float*)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);  // (the caller gave W floats more)
    auto one = [&](int s, float* at, int t) {
        attend<T, D>(q + (size_t)rows[s] * q_row, (const T*)key_cache, (const T*)value_cache,
                     tables + (size_t)s * table_row, lens[s], bs, kvh, heads, scale, out + (size_t)rows[s] * out_row,
                     at, t);
    };
    int shorts = 0;
    for (int s = 0; s < n; s++) {
        if (lens[s] >= PARALLEL_MIN)
            one(s, scratch, threads);
        else
            shorts++;
    }
    if (!shorts) return;
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads) if (threads > 1 && shorts > 1)
    for (int s = 0; s < n; s++) {
        if (lens[s] < PARALLEL_MIN) one(s, scratch + slot * omp_thread(), 1);
    }
}

template <int D>
size_t scratch_for(int heads, int len, int threads) {
    return scratch_floats<D>(heads, len) * (threads > 1 ? threads : 1) + W;
}

// A few rows of activations (m, in) times an int8 weight (out, in) with one scale per output
// row: out[r][o] = scale[o] * sum_i x[r][i] * w[o][i], in float32, rounded once. 16 output rows
// at a time (their weights stay in the cache for every activation row), their 16 sums across
// lanes together; the output rows split over the threads. xf: m * in floats, 64-byte aligned.
constexpr int R = 4;  // activation rows per pass over a block of weights

// RN activation rows (from r0) against one block of n <= W weight rows from o0: each weight
// vector converted once for the RN rows; each row's sums the same as alone.
template <typename T, int RN>
void int8_block(const float* xf, int in, const int8_t* w, int o0, int n, f16v scale, T* out, long out_row, int r0) {
    const int C = in / W;
    f16v part[RN][W];
    for (int o = 0; o < n; o++) {
        const int8_t* wr = w + (size_t)(o0 + o) * in;
        f16v s[RN] = {};
        for (int c = 0; c < C; c++) {
            const f16v wv = int8_head(wr, c, sizeof(T) == 2);
            for (int r = 0; r < RN; r++) s[r] += ((const f16v*)(xf + (size_t)(r0 + r) * in))[c] * wv;
        }
        for (int r = 0; r < RN; r++) part[r][o] = s[r];
    }
    for (int r = 0; r < RN; r++) {
        for (int o = n; o < W; o++) part[r][o] = f16v{};
        f16v sums = sum_lanes(part[r]) * scale;
        for (int o = 0; o < n; o++) store(out + (size_t)(r0 + r) * out_row + o0 + o, sums[o]);
    }
}

template <typename T>
void int8_rows(const T* x, long x_row, int m, const int8_t* w, const T* scales, int out_features, int in, T* out,
               long out_row, float* xf, int threads) {
    for (int r = 0; r < m; r++) load_head(x + (size_t)r * x_row, (f16v*)(xf + (size_t)r * in), in / W);
    const int blocks = (out_features + W - 1) / W;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int b = 0; b < blocks; b++) {
        const int o0 = b * W, n = out_features - o0 < W ? out_features - o0 : W;
        f16v scale = {};
        for (int o = 0; o < n; o++) scale[o] = load(scales + o0 + o);
        int r0 = 0;
        for (; r0 + R <= m; r0 += R) int8_block<T, R>(xf, in, w, o0, n, scale, out, out_row, r0);
        switch (m - r0) {
            case 3:
                int8_block<T, 3>(xf, in, w, o0, n, scale, out, out_row, r0);
                break;
            case 2:
                int8_block<T, 2>(xf, in, w, o0, n, scale, out, out_row, r0);
                break;
            case 1:
                int8_block<T, 1>(xf, in, w, o0, n, scale, out, out_row, r0);
                break;
        }
    }
}

// RMSNorm of bfloat16 rows as transformers computes it in 16 bits: y = bf16(x * r) with
// r = 1 / sqrt(mean(x^2) + eps) in float32, then bf16(y * w). The squares are summed W lanes at
// a time and the lanes in a fixed order, so a row's result never depends on the others.
void rms_norm_rows(const uint16_t* x, long x_row, int m, int n, const uint16_t* w, float eps, uint16_t* out,
                   long out_row, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && m >= 64)
    for (int r = 0; r < m; r++) {
        const uint16_t* xr = x + (size_t)r * x_row;
        uint16_t* o = out + (size_t)r * out_row;
        f16v acc = {};
        for (int i = 0; i < n; i += W) {
            f16v v;
            for (int l = 0; l < W; l++) v[l] = load(xr + i + l);
            acc += v * v;
        }
        float sum = 0.0f;
        for (int l = 0; l < W; l++) sum += acc[l];
        const float inv = 1.0f / __builtin_sqrtf(sum / (float)n + eps);
        for (int i = 0; i < n; i++) {
            uint16_t y;
            store(&y, load(xr + i) * inv);
            store(o + i, load(&y) * load(w + i));
        }
    }
}

}  // namespace

// The decodes of one step: sequence s's query row rows[s] over its first lens[s] positions,
// through block table row s; its output into row rows[s] of `output`. dtype: 0 float32,
// 1 bfloat16 (query, caches and output alike). Returns 0, or -1 for a head size it was not
// built for (the caller then takes the torch path).
extern "C" int pagefleet_decode(int dtype, int head_dim, const void* query, long q_row, const void* key_cache,
                                const void* value_cache, const int32_t* tables, long table_row, const int32_t* rows,
                                const int32_t* lens, int n, int block_size, int kvh, int heads, float scale,
                                void* output, long out_row, float* scratch, int threads) {
#define PAGEFLEET_CASE(T, D)                                                                                       \
    attend_all<T, D>(query, q_row, key_cache, value_cache, tables, table_row, rows, lens, n, block_size, kvh, heads, \
                     scale, output, out_row, scratch, threads);                                                    \
    return 0;
#define PAGEFLEET_SIZES(T)       \
    switch (head_dim) {          \
        case 32:                 \
            PAGEFLEET_CASE(T, 32)  \
        case 64:                 \
            PAGEFLEET_CASE(T, 64)  \
        case 96:                 \
            PAGEFLEET_CASE(T, 96)  \
        case 128:                \
            PAGEFLEET_CASE(T, 128) \
        case 256:                \
            PAGEFLEET_CASE(T, 256) \
    }
    if (dtype == 0) {
        PAGEFLEET_SIZES(float)
    } else if (dtype == 1) {
        PAGEFLEET_SIZES(uint16_t)
    }
    return -1;
}

// Floats of scratch a call needs for its longest row on `threads` threads (16 more, to align it).
extern "C" long pagefleet_decode_scratch(int head_dim, int heads, int longest, int threads) {
    switch (head_dim) {
        case 32:
            return (long)scratch_for<32>(heads, longest, threads);
        case 64:
            return (long)scratch_for<64>(heads, longest, threads);
        case 96:
            return (long)scratch_for<96>(heads, longest, threads);
        case 128:
            return (long)scratch_for<128>(heads, longest, threads);
        case 256:
            return (long)scratch_for<256>(heads, longest, threads);
    }
    return -1;
}

// x (m, in) times an int8 weight (out, in) scaled per output row (see int8_rows); in a multiple
// of 32. dtype as pagefleet_decode's. xf: m * in + 16 floats.
extern "C" int pagefleet_int8_rows(int dtype, const void* x, long x_row, int m, const int8_t* w, const void* scales,
                                   int out_features, int in, void* out, long out_row, float* xf, int threads) {
    if (in % (2 * W) != 0) return -1;
    xf = (float*)(((uintptr_t)xf + 63) & ~(uintptr_t)63);
    if (dtype == 0)
        int8_rows<float>((const float*)x, x_row, m, w, (const float*)scales, out_features, in, (float*)out, out_row, xf,
                         threads);
    else if (dtype == 1)
        int8_rows<uint16_t>((const uint16_t*)x, x_row, m, w, (const uint16_t*)scales, out_features, in,
                            (uint16_t*)out, out_row, xf, threads);
    else
        return -1;
    return 0;
}

// RMSNorm of m bfloat16 rows of n (a multiple of 16) with a bfloat16 weight (see rms_norm_rows).
extern "C" int pagefleet_rms_norm(const void* x, long x_row, int m, int n, const void* w, float eps, void* out,
                                  long out_row, int threads) {
    if (n % W != 0) return -1;
    rms_norm_rows((const uint16_t*)x, x_row, m, n, (const uint16_t*)w, eps, (uint16_t*)out, out_row, threads);
    return 0;
}

// Each token's K and V rows (row_bytes each: its KV heads side by side) into its slot of the
// pool, slots[t] < 0 skipped; -1 (nothing written) when a slot lies past the pool's.
extern "C" int pagefleet_write_kv(const void* key, long k_row, const void* value, long v_row, void* key_cache,
                                  void* value_cache, long num_slots, const int64_t* slots, int n, long row_bytes) {
    for (int t = 0; t < n; t++)
        if (slots[t] >= num_slots) return -1;
    for (int t = 0; t < n; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        memcpy((char*)key_cache + slot * row_bytes, (const char*)key + t * k_row, row_bytes);
        memcpy((char*)value_cache + slot * row_bytes, (const char*)value + t * v_row, row_bytes);
    }
    return 0;
}

// Rotary embedding of bfloat16 heads as transformers computes it: out = bf16(bf16(x * cos) +
// bf16(rotate_half(x) * sin)), each product and the sum rounded as torch rounds them (the
// products of two bfloat16 values are exact in float32, so nothing is fused away). x: (T, H, d)
// rows of x_row elements; cos, sin: (T, d), the sin's first half negated (rotate_half's sign);
// out: (T, H, d) contiguous.
extern "C" int pagefleet_rotary(const void* x, long x_row, int tokens, int heads, int d, const void* cos,
                                const void* sin, void* out) {
    if (d % 2 != 0) return -1;
    const uint16_t *xs = (const uint16_t*)x, *c = (const uint16_t*)cos, *sn = (const uint16_t*)sin;
    uint16_t* o = (uint16_t*)out;
    const int half = d / 2;
    for (int t = 0; t < tokens; t++)
        for (int h = 0; h < heads; h++) {
            const uint16_t* xh = xs + (size_t)t * x_row + (size_t)h * d;
            uint16_t* oh = o + ((size_t)t * heads + h) * d;
            for (int i = 0; i < d; i++) {
                uint16_t a, b;
                store(&a, load(xh + i) * load(c + (size_t)t * d + i));
                store(&b, load(xh + (i + half) % d) * load(sn + (size_t)t * d + i));
                store(oh + i, load(&a) + load(&b));
            }
        }
    return 0;
}
