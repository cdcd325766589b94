// A decoder layer's steps besides its products, for float32 steps on the CPU: attention over a static cache (one
// query at a time), and for eager steps its RMSNorm, its rotary embedding with the cache writes and silu(gate) * up,
// one call each; and for a 4-bit target's eager steps the whole layer in one call, products included (at the end).
//
// ATTENTION, by the same operations whatever else is in the pass (attention.py says why). For query t of row b and
// head h (kv head h / (H / KVH)):
//
//     visit the positions c_1 < c_2 < ... < c_n that mask[b, 0, t] allows, in increasing order, in S = ceil(n / 128)
//     spans of equal size (to within one); in span j, s_i = scale (q . k[c_i]), m_j = max_i s_i, p_i = e^(s_i - m_j),
//     l_j = sum_i p_i, a_j = sum_i p_i v[c_i]; then M = max_j m_j, w_j = e^(m_j - M),
//     out = (sum_j w_j a_j) / (sum_j w_j l_j)   (one span: out = a_1 / l_1).
//
// Each number is made by a fixed sequence of operations on what the query sees: a score's dot product by the same
// lanes and tree of additions whichever group of keys and heads scored together it is in (a last group is filled
// with zero keys), the sums in the order of i (l_j's in 8 lanes, i mod 8, then a fixed tree), the spans' in the
// order of j, and the spans a function of n alone. So
// a query's result depends only on the sequence of keys and values it sees, not on where they lie in the cache, how
// many other queries, heads or rows the pass holds, or how threads split them. Vectors are 8 floats (AVX2 and FMA),
// with independent chains of multiply-adds where the order allows, and -ffp-contract=off (kernels.py), so the
// compiler fuses nothing on its own. Tasks (row, query, kv head, span) are split among torch's threads; a task takes
// the heads that share its kv head three at a time, so each key and value is read (and widened) once for three.
// The cache holds float32, or float16 (a 4-bit target's, as llama.cpp keeps it): its numbers are widened exactly
// (F16C) as they are read, so the operations are the same.
// Over plain arrays (kernels.h): ops.cpp checks the tensors and registers the ops.
//
// NORM AND ROTARY EMBEDDING. Eager PyTorch runs an RMSNorm as six operations, and a layer's rotary embedding, with
// the split of the fused q|k|v product and the cache writes, as about twenty; each costs a few microseconds of
// dispatch for well under a microsecond of arithmetic on a token's 576 numbers (with these calls an eager 4-bit
// step of the embedded model went from 10.0 to 7.2 ms on a 2-core EPYC). step.py's ``rms_norm`` and
// ``decoder_layer`` call them; compiled steps leave these steps to inductor, which fuses them itself. Each output row is computed by the same operations whatever else is in the
// batch. The rotary embedding does, element by element, what PyTorch's x cos + rotate_half(x) sin does (a product,
// a product, a sum), so its results equal eager PyTorch's bit for bit; the norm sums its squares in double precision
// (8 lanes, then the lanes in order), so its mean is the same on every instruction set.
#include "kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

struct Half {  // a float16's bits, as a cache holds them
  uint16_t bits;
  explicit operator float() const { return _cvtsh_ss(bits); }  // (exact, as widening by 8 is: F16C)
};


inline __m256 madd(__m256 a, __m256 b, float c) { return _mm256_fmadd_ps(a, b, _mm256_set1_ps(c)); }

// e^x for 8 floats x <= 0: 2^n times a degree-6 polynomial of the remainder r = x - n ln 2 (Cephes' expf
// coefficients), lane by lane, so a value's result never depends on its neighbours.
// Here x = s - m <= 0; below -87 it is held at -87, where e^x (1.6e-38) is already negligible.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = madd(p, r, 1.3981999507e-3f);
  p = madd(p, r, 8.3334519073e-3f);
  p = madd(p, r, 4.1665795894e-2f);
  p = madd(p, r, 1.6666665459e-1f);
  p = madd(p, r, 5.0000001201e-1f);
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(power));
}

// 8 of a cache's keys or values, as floats: float32 as it is, float16 widened (exact, by F16C).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// Lane j: the sum of the 8 lanes of a[j], by the same tree of additions for every j.
inline __m256 sums8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Lane j < 4: the sum of the 8 lanes of a[j], by sums8's tree of additions.
inline __m128 sums4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

// w[0] + ... + w[n - 1]: lane l sums the w[i] with i = l mod 8 in the order of i, then the lanes by sums8's tree (a
// chain of one addition a weight waited 3 cycles on each).
inline float lane_sum(const float* w, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(w + i));
  if (i < n) {
    float last[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(last, w + i, (n - i) * sizeof(float));
    acc = _mm256_add_ps(acc, _mm256_loadu_ps(last));
  }
  const __m256 zero = _mm256_setzero_ps();
  return _mm256_cvtss_f32(sums8(acc, zero, zero, zero, zero, zero, zero, zero));
}

constexpr int64_t AHEAD = 8;  // positions a span's first heads prefetch ahead

// HG heads' scores against KEYS keys at a time, each head's keys' dot products side by side: the keys are read (and
// a float16 cache's widened) once for the heads that share them. Key j's score for head h: lane l of acc[h][j] sums
// q_h[d] k_j[d] over the dimensions d = l mod 8 in order, then sums8's tree (sums4's, its first four lanes), then the
// scale: the same operations for every head count and key group.
template <int HG, int KEYS, typename T>
void score(const float* q, int64_t D, const T* const* seen, const T* const* rows, int64_t n, float s, float* weight,
           int64_t wstride, bool fetch) {
  const int64_t D8 = D - D % 8;
  const int64_t lines = (D * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  for (int64_t i = 0; i < n; i += KEYS) {
    if (fetch)  // keys AHEAD positions on, and the values the weighing reads next (the cache is read from memory)
      for (int64_t j = i + AHEAD; j < std::min(n, i + AHEAD + KEYS); ++j)
        for (int64_t l = 0; l < lines; ++l) {
          _mm_prefetch(reinterpret_cast<const char*>(seen[j]) + 64 * l, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(rows[j]) + 64 * l, _MM_HINT_T1);
        }
    __m256 acc[HG][KEYS];
#pragma GCC unroll 16
    for (int h = 0; h < HG; ++h)
#pragma GCC unroll 16
      for (int j = 0; j < KEYS; ++j) acc[h][j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D8; d += 8) {
      __m256 qd[HG];
#pragma GCC unroll 16
      for (int h = 0; h < HG; ++h) qd[h] = _mm256_loadu_ps(q + h * D + d);
#pragma GCC unroll 16
      for (int j = 0; j < KEYS; ++j) {
        const __m256 k = load8(seen[i + j] + d);
#pragma GCC unroll 16
        for (int h = 0; h < HG; ++h) acc[h][j] = _mm256_fmadd_ps(qd[h], k, acc[h][j]);
      }
    }
    // Each head's key sums, then the scale (one product each), by loops of fixed counts, unrolled: with a loop of
    // the dimensions left among them, the accumulators stayed in memory and were stored at every step of the loop
    // above; and the scale as a vector's product (a store then scalar loads of its lanes waits on the store).
    const int64_t tail = D - D8;
#pragma GCC unroll 16
    for (int h = 0; h < HG; ++h) {
      float* w = weight + h * wstride + i;
      if constexpr (KEYS == 8) {
        const __m256 sums = sums8(acc[h][0], acc[h][1], acc[h][2], acc[h][3], acc[h][4], acc[h][5], acc[h][6],
                                  acc[h][7]);
        _mm256_storeu_ps(w, tail ? sums : _mm256_mul_ps(sums, _mm256_set1_ps(s)));
      } else {
        const __m128 sums = sums4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
        _mm_storeu_ps(w, tail ? sums : _mm_mul_ps(sums, _mm_set1_ps(s)));
      }
    }
    if (tail)  // the dimensions past the last 8, one by one (then the same product by the scale)
#pragma GCC unroll 16
      for (int h = 0; h < HG; ++h) {
        float* w = weight + h * wstride + i;
#pragma GCC unroll 16
        for (int j = 0; j < KEYS; ++j) {
          for (int64_t d = D8; d < D; ++d) w[j] += q[h * D + d] * static_cast<float>(seen[i + j][d]);
          w[j] *= s;
        }
      }
  }
}

// out_h[d] = (sum_i p_h[i] v_i[d]) / divisor_h for HG heads and CH chunks of 8 dimensions from d0: each sum runs over
// i in order, the heads' and chunks' side by side (independent chains of multiply-adds), each value read (and a
// float16 one widened) once for the heads that share it.
template <int HG, int CH, typename T>
void weigh_values(const float* p, int64_t pstride, int64_t n, const T* const* rows, int64_t d0, const float* divisor,
                  float* out, int64_t ostride) {
  __m256 acc[HG][CH];
#pragma GCC unroll 16
  for (int h = 0; h < HG; ++h)
#pragma GCC unroll 16
    for (int c = 0; c < CH; ++c) acc[h][c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const T* v = rows[i] + d0;
#pragma GCC unroll 16
    for (int c = 0; c < CH; ++c) {
      const __m256 value = load8(v + 8 * c);
#pragma GCC unroll 16
      for (int h = 0; h < HG; ++h) acc[h][c] = _mm256_fmadd_ps(_mm256_set1_ps(p[h * pstride + i]), value, acc[h][c]);
    }
  }
#pragma GCC unroll 16
  for (int h = 0; h < HG; ++h)
#pragma GCC unroll 16
    for (int c = 0; c < CH; ++c)
      _mm256_storeu_ps(out + h * ostride + d0 + 8 * c, _mm256_div_ps(acc[h][c], _mm256_set1_ps(divisor[h])));
}

// weigh_values<HG, chunks> for chunks 1 .. CH, chosen at run time: only those a group of HG heads can ask for are
// compiled (all eight for each group had taken about 1 s of the first build's CPU, with nothing gained).
template <int HG, int CH, typename T>
void weigh_chunks(int64_t chunks, const float* weight, int64_t wstride, int64_t n, const T* const* rows, int64_t d0,
                  const float* divisor, float* out, int64_t ostride) {
  if (chunks == CH)
    weigh_values<HG, CH>(weight, wstride, n, rows, d0, divisor, out, ostride);
  else if constexpr (CH > 1)
    weigh_chunks<HG, CH - 1>(chunks, weight, wstride, n, rows, d0, divisor, out, ostride);
}

// Attention of HG consecutive heads' queries q [HG, D] over one span's keys seen[0 .. n) (followed by zero keys to a
// whole group) and values rows[0 .. n): head h's result, divided by its weights' sum where whole, into out + h
// ostride; else undivided, with its largest score and its weights' sum at out[-2] and out[-1] (the combining's).
template <int HG, typename T>
void attend_span(const float* q, int64_t D, const T* const* seen, const T* const* rows, int64_t n, float s,
                 float* weight, int64_t wstride, bool whole, float* out, int64_t ostride, bool fetch) {
  const int64_t D8 = D - D % 8;
  constexpr int KEYS = HG == 1 ? 8 : 4;  // (independent chains enough to keep the multiply-adds busy)
  score<HG, KEYS>(q, D, seen, rows, n, s, weight, wstride, fetch);
  float divisor[HG];
  for (int h = 0; h < HG; ++h) {
    float* w = weight + h * wstride;
    // The largest score, 8 lanes at a time (a maximum is exact in any order); lanes past n are left out.
    __m256 most = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) most = _mm256_max_ps(most, _mm256_loadu_ps(w + i));
    float top = hmax(most);
    for (; i < n; ++i) top = w[i] > top ? w[i] : top;
    const __m256 shift = _mm256_set1_ps(top);  // (the last 8 lanes may run past n: never summed)
    for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(w + i, exp8(_mm256_sub_ps(_mm256_loadu_ps(w + i), shift)));
    const float total = lane_sum(w, n);
    divisor[h] = whole ? total : 1.0f;  // (undivided: dividing by 1 is exact)
    if (!whole) {
      out[h * ostride - 2] = top;
      out[h * ostride - 1] = total;
    }
  }
  // Chunks of 8 dimensions, up to 8 at a time for one head, 4 for more (so 3 heads' sums, their weights and a value
  // fit 16 registers).
  constexpr int CHUNKS = HG == 1 ? 8 : 4;
  for (int64_t d0 = 0; d0 < D8; d0 += 8 * CHUNKS)
    weigh_chunks<HG, CHUNKS>(std::min<int64_t>(CHUNKS, (D8 - d0) / 8), weight, wstride, n, rows, d0, divisor, out,
                             ostride);
  for (int h = 0; h < HG; ++h)
    for (int64_t d = D8; d < D; ++d) {
      float acc = 0.0f;
      for (int64_t i = 0; i < n; ++i) acc += weight[h * wstride + i] * static_cast<float>(rows[i][d]);
      out[h * ostride + d] = acc / divisor[h];
    }
}

// A query's positions, at most SPAN to a task (see the top). Why spans: one query's attention was 3 tasks (one per
// kv head of the embedded model) on 2 threads, so one thread did twice the other's share, and at long contexts,
// where attention costs most, a task's keys and values no longer stayed in the core's caches for its three heads.
constexpr int64_t SPAN = 128;
constexpr int64_t HEADS = 3;  // heads of a kv head's group attended together

inline int64_t spans_of(int64_t n) { return n > SPAN ? (n + SPAN - 1) / SPAN : 1; }

// The positions [0, C) that allows[0 .. C) allows, in increasing order, into at; returns how many.
inline int64_t allowed_positions(const bool* allows, int64_t C, int32_t* at) {
  int64_t n = 0;
  for (int64_t c = 0; c < C;) {
    uint64_t eight = 0;  // (a row's cache is mostly a run of allowed positions, then a run of unwritten ones)
    if (c + 8 <= C) std::memcpy(&eight, allows + c, 8);
    if (c + 8 <= C && (eight == 0 || eight == 0x0101010101010101ULL)) {
      if (eight)
        for (int j = 0; j < 8; ++j) at[n++] = static_cast<int32_t>(c + j);
      c += 8;
      continue;
    }
    for (const int64_t stop = c + 8 <= C ? c + 8 : c + 1; c < stop; ++c)
      if (allows[c]) at[n++] = static_cast<int32_t>(c);
  }
  return n;
}

struct Task {
  int64_t bw, g, first, count, span;  // query bw (row b = bw / W), kv head g, its positions first .. first + count
};

// Scratch that outlives a call, so a long context's call does not map and zero fresh pages each time.
template <typename T>
T* room(std::vector<T>& held, size_t size) {
  if (held.size() < size) held.resize(size);
  return held.data();
}

// out [B, W, H, D] = attention of q over the cache's keys kp and values vp [>= B, KVH, C, D], of element T.
template <typename T>
void attend_over(const float* qp, const T* kp, const T* vp, const bool* mp, float s, int64_t B, int64_t W,
                 int64_t H, int64_t D, int64_t KVH, int64_t C, float* op) {
  const int64_t G = H / KVH, D8 = D - D % 8, BW = B * W;
  static thread_local std::vector<int32_t> held_positions;
  static thread_local std::vector<int64_t> held_counts;
  static thread_local std::vector<float> held_partial;
  int32_t* positions = room(held_positions, static_cast<size_t>(BW * C));
  int64_t* counts = room(held_counts, static_cast<size_t>(BW));
  fuzzyspec::parallel_for(0, BW, 8, [&](int64_t begin, int64_t end) {
    for (int64_t bw = begin; bw < end; ++bw) counts[bw] = allowed_positions(mp + bw * C, C, positions + bw * C);
  });
  // Tasks in the order row, kv head, span, query: a row's queries see mostly the same positions, so one span's tasks
  // follow one another and find its keys and values in the core's caches (6 queries after 2,000 positions: 1.06-1.10x
  // against the order row, query, kv head, span).
  std::vector<Task> tasks;
  int64_t most = 1;  // spans of the query with the most
  for (int64_t bw = 0; bw < BW; ++bw) most = std::max(most, spans_of(counts[bw]));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < KVH; ++g)
      for (int64_t i = 0; i < most; ++i)
        for (int64_t bw = b * W; bw < (b + 1) * W; ++bw) {
          const int64_t n = counts[bw], spans = spans_of(n);
          if (i < spans)  // span i: positions i n / spans .. (i + 1) n / spans (rounded down)
            tasks.push_back({bw, g, i * n / spans, (i + 1) * n / spans - i * n / spans, i});
        }
  // A span's partial result per query and head: its largest score, its sum of weights, its weighted sum of values.
  const int64_t stride = D + 2;
  float* partial = most > 1 ? room(held_partial, static_cast<size_t>(BW * H * most * stride)) : nullptr;
  fuzzyspec::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<const T*> seen(SPAN + 8), rows(SPAN);  // the keys and values a task's span holds
    std::vector<float> weight(HEADS * (SPAN + 8));
    std::vector<T> zeros(D, T(0.0f));
    for (int64_t t = begin; t < end; ++t) {
      const Task& task = tasks[t];
      const int64_t n = task.count, bw = task.bw, g = task.g, b = bw / W, head = (b * KVH + g) * C * D;
      const bool whole = spans_of(counts[bw]) == 1;
      const int32_t* at = positions + bw * C + task.first;
      for (int64_t i = 0; i < n; ++i) {
        rows[i] = vp + head + at[i] * D;
        seen[i] = kp + head + at[i] * D;
      }
      for (int64_t i = n; i < n + 8; ++i) seen[i] = zeros.data();  // a last group of keys is filled with zeros
      float* o = whole ? op + (bw * H + g * G) * D : partial + ((bw * H + g * G) * most + task.span) * stride + 2;
      const int64_t ostride = whole ? D : most * stride;
      const float* q = qp + (bw * H + g * G) * D;
      for (int64_t h = 0; h < G; h += HEADS) {  // the heads sharing these keys and values, three at a time
        switch (std::min<int64_t>(HEADS, G - h)) {
          case 3: attend_span<3>(q + h * D, D, seen.data(), rows.data(), n, s, weight.data(), SPAN + 8, whole,
                                 o + h * ostride, ostride, h == 0); break;
          case 2: attend_span<2>(q + h * D, D, seen.data(), rows.data(), n, s, weight.data(), SPAN + 8, whole,
                                 o + h * ostride, ostride, h == 0); break;
          case 1: attend_span<1>(q + h * D, D, seen.data(), rows.data(), n, s, weight.data(), SPAN + 8, whole,
                                 o + h * ostride, ostride, h == 0); break;
        }
      }
    }
  });
  if (most == 1) return;
  // Spans combined in their order: with M the largest of their largest scores and w_i = e^(m_i - M),
  // out = (sum_i w_i acc_i) / (sum_i w_i total_i).
  fuzzyspec::parallel_for(0, BW * H, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> scale(most + 8);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t spans = spans_of(counts[bh / H]);
      if (spans == 1) continue;
      const float* part = partial + bh * most * stride;
      float top = -INFINITY;
      for (int64_t i = 0; i < spans; ++i) top = std::max(top, part[i * stride]);
      for (int64_t i = 0; i < spans; i += 8) {
        float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t j = i; j < std::min(spans, i + 8); ++j) lanes[j - i] = part[j * stride] - top;
        _mm256_storeu_ps(&scale[i], exp8(_mm256_loadu_ps(lanes)));
      }
      float total = 0.0f;
      for (int64_t i = 0; i < spans; ++i) total += scale[i] * part[i * stride + 1];
      float* o = op + bh * D;
      for (int64_t d = 0; d < D8; d += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < spans; ++i)
          acc = _mm256_fmadd_ps(_mm256_set1_ps(scale[i]), _mm256_loadu_ps(part + i * stride + 2 + d), acc);
        _mm256_storeu_ps(o + d, _mm256_div_ps(acc, _mm256_set1_ps(total)));
      }
      for (int64_t d = D8; d < D; ++d) {
        float acc = 0.0f;
        for (int64_t i = 0; i < spans; ++i) acc += scale[i] * part[i * stride + 2 + d];
        o[d] = acc / total;
      }
    }
  });
}

// x cos + rotate_half(x) sin for one head's D numbers (rotate_half(x) = [-x2, x1] of its halves x1, x2).
inline void rotate(const float* x, const float* cos, const float* sin, int64_t dim, float* out, int64_t stride) {
  const int64_t half = dim / 2;
  for (int64_t j = 0; j < dim; ++j) {
    const float turned = j < half ? -x[j + half] : x[j - half];
    const float a = x[j] * cos[j];
    const float b = turned * sin[j];
    out[j * stride] = a + b;
  }
}

// n numbers into a cache: float32 as they are; float16 rounded to the nearest, ties to even (as PyTorch rounds),
// by F16C, 8 at a time where they lie side by side.
inline void put(const float* x, int64_t n, float* out, int64_t stride) {
  for (int64_t j = 0; j < n; ++j) out[j * stride] = x[j];
}
inline void put(const float* x, int64_t n, Half* out, int64_t stride) {
  constexpr int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  int64_t j = 0;
  for (; stride == 1 && j + 8 <= n; j += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), _mm256_cvtps_ph(_mm256_loadu_ps(x + j), nearest));
  for (; j < n; ++j) out[j * stride].bits = _cvtss_sh(x[j], nearest);
}

// A layer's rotary embedding and cache writes: q, k, v [B, T, heads * D] (q's, k's, v's heads side by side, as the
// projections give them), cos and sin [B, T, 1, D]; k rotated and v go into keys and values [slots, kv_heads,
// capacity, D] (element strides kst, vst) at row slots[b] and position positions[b * T + t]; q rotated into qd
// [B, T, heads, D].
template <typename T>
void store_rows(const float* qs, const float* ks, const float* vs, const int64_t* steps, const float* cs,
                const float* ss, T* kd, T* vd, const int64_t* kst, const int64_t* vst, const int64_t* slots,
                const int64_t* positions, int64_t rows, int64_t width, int64_t heads, int64_t kv_heads, int64_t dim,
                float* qd) {
  const int64_t ks0 = kst[0], ks1 = kst[1], ks2 = kst[2], ks3 = kst[3];
  const int64_t vs0 = vst[0], vs1 = vst[1], vs2 = vst[2], vs3 = vst[3];
  std::vector<float> rotated(dim);
  for (int64_t b = 0; b < rows; ++b) {
    const int64_t s = slots[b];
    for (int64_t t = 0; t < width; ++t) {
      const int64_t token = b * width + t, p = positions[token];
      const float *c = cs + token * dim, *n = ss + token * dim;
      for (int64_t h = 0; h < heads; ++h)
        rotate(qs + token * steps[0] + h * dim, c, n, dim, qd + (token * heads + h) * dim, 1);
      for (int64_t h = 0; h < kv_heads; ++h) {
        rotate(ks + token * steps[1] + h * dim, c, n, dim, rotated.data(), 1);
        put(rotated.data(), dim, kd + s * ks0 + h * ks1 + p * ks2, ks3);
        put(vs + token * steps[2] + h * dim, dim, vd + s * vs0 + h * vs1 + p * vs2, vs3);
      }
    }
  }
}

}  // namespace

namespace fuzzyspec {

void attend(const float* q, const void* keys, const void* values, bool half, const bool* mask, float scale,
            int64_t B, int64_t W, int64_t H, int64_t D, int64_t KVH, int64_t C, float* out) {
  if (half)
    attend_over(q, static_cast<const Half*>(keys), static_cast<const Half*>(values), mask, scale, B, W, H, D, KVH, C,
                out);
  else
    attend_over(q, static_cast<const float*>(keys), static_cast<const float*>(values), mask, scale, B, W, H, D, KVH,
                C, out);
}

// dst = scale * (src / sqrt(mean(src^2) + eps)) per row of size (float32), the squares summed in double precision.
void rms_norm(const float* src, const float* scale, int64_t rows, int64_t size, float eps, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = src + r * size;
    double lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= size; i += 8)
      for (int j = 0; j < 8; ++j) lanes[j] += static_cast<double>(row[i + j] * row[i + j]);
    for (; i < size; ++i) lanes[i % 8] += static_cast<double>(row[i] * row[i]);
    double sum = 0;
    for (int j = 0; j < 8; ++j) sum += lanes[j];
    const float mean = static_cast<float>(sum / static_cast<double>(size));
    const float inverse = 1.0f / std::sqrt(mean + eps);
    float* target = dst + r * size;
    for (i = 0; i < size; ++i) target[i] = scale[i] * (row[i] * inverse);
  }
}

void rope_store(const float* q, const float* k, const float* v, const int64_t* token_strides, const float* cos,
                const float* sin, const Cache& cache, const int64_t* slots, const int64_t* positions, int64_t rows,
                int64_t width, int64_t heads, int64_t kv_heads, int64_t dim, float* q_out) {
  if (cache.half)
    store_rows(q, k, v, token_strides, cos, sin, static_cast<Half*>(cache.keys), static_cast<Half*>(cache.values),
               cache.key_strides, cache.value_strides, slots, positions, rows, width, heads, kv_heads, dim, q_out);
  else
    store_rows(q, k, v, token_strides, cos, sin, static_cast<float*>(cache.keys), static_cast<float*>(cache.values),
               cache.key_strides, cache.value_strides, slots, positions, rows, width, heads, kv_heads, dim, q_out);
}

// A tree's kept path moved down in one slot of a layer's cache tensor: position start + columns[i] goes to
// start + i. Columns ascend and columns[i] >= i, so moving them in order never overwrites one still to be read.
// (In Python, two indexing operations a tensor: 0.8 ms a tree step for the embedded model's 60 tensors on a 2-core
// EPYC.)
void keep_columns(char* row, int64_t heads, int64_t head_stride, int64_t position_stride, int64_t bytes,
                  int64_t start, const int64_t* columns, int64_t count) {
  for (int64_t h = 0; h < heads; ++h) {
    char* head = row + h * head_stride;
    for (int64_t i = 0; i < count; ++i)
      if (columns[i] != i)
        std::memcpy(head + (start + i) * position_stride, head + (start + columns[i]) * position_stride, bytes);
  }
}

// silu(g) u = g sigmoid(g) u, 8 lanes at a time, each lane by the same operations (a row's last few numbers are
// computed as a whole vector, padded with zeros): sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below,
// e = e^-|g| (exp8's range).
void silu_mul(const float* gate_up, int64_t rows, int64_t inner, int64_t stride, float* out) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  auto eight = [&](__m256 g, __m256 u) {
    const __m256 e = exp8(_mm256_or_ps(g, sign));  // e^-|g|
    const __m256 below = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(one, e, below), _mm256_add_ps(one, e));
    return _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), u);
  };
  for (int64_t r = 0; r < rows; ++r) {
    const float *gate = gate_up + r * stride, *up = gate + inner;
    float* target = out + r * inner;
    int64_t j = 0;
    for (; j + 8 <= inner; j += 8)
      _mm256_storeu_ps(target + j, eight(_mm256_loadu_ps(gate + j), _mm256_loadu_ps(up + j)));
    if (j < inner) {
      float g[8] = {0, 0, 0, 0, 0, 0, 0, 0}, u[8] = {0, 0, 0, 0, 0, 0, 0, 0}, result[8];
      std::memcpy(g, gate + j, (inner - j) * sizeof(float));
      std::memcpy(u, up + j, (inner - j) * sizeof(float));
      _mm256_storeu_ps(result, eight(_mm256_loadu_ps(g), _mm256_loadu_ps(u)));
      std::memcpy(target + j, result, (inner - j) * sizeof(float));
    }
  }
}

// The layer as step.py's decoder_layer runs it through the separate ops (norm, q|k|v product, rotary embedding and
// cache writes, attention, o product and residual, norm, gate|up product, silu_mul, down product and residual): the
// same functions on the same numbers in the same order, so the same results, in one call where the separate ops
// made about 20, each a few microseconds of dispatch and Python (an eager 4-bit AR step of the embedded model went
// from 10.5 to 7.2 ms on a 2-core AVX2 EPYC).
void decoder_layer(const float* h, const Layer& w, const float* cos, const float* sin, const Cache& cache,
                   int64_t capacity, const bool* mask, const int64_t* slots, const int64_t* positions, int64_t rows,
                   int64_t width, float* out) {
  const int64_t M = rows * width, H = w.hidden, QD = w.heads * w.dim, KD = w.kv_heads * w.dim;
  const int64_t qkv_n = w.qkv_groups * ROWS, o_n = w.o_groups * ROWS, gate_up_n = w.gate_up_groups * ROWS,
                down_n = w.down_groups * ROWS;
  static thread_local std::vector<float> held;
  float* normed = room(held, static_cast<size_t>(M * (H + qkv_n + 2 * QD + std::max(o_n, down_n) + gate_up_n +
                                                      w.inner)));
  float *qkv = normed + M * H, *q = qkv + M * qkv_n, *attended = q + M * QD, *projected = attended + M * QD,
        *gate_up = projected + M * std::max(o_n, down_n), *act = gate_up + M * gate_up_n;
  const auto product = w.eight ? product_q8 : product_q4;
  if (w.input_norm != nullptr) rms_norm(h, w.input_norm, M, H, w.input_eps, normed);
  product(w.input_norm != nullptr ? normed : h, M, H, w.qkv, w.qkv_groups, qkv);
  const int64_t steps[3] = {qkv_n, qkv_n, qkv_n};
  rope_store(qkv, qkv + QD, qkv + QD + KD, steps, cos, sin, cache, slots, positions, rows, width, w.heads,
             w.kv_heads, w.dim, q);
  bool in_order = true;  // row b in slot b: one call; else a call a row, over its own slot (the same numbers)
  for (int64_t b = 0; b < rows; ++b) in_order = in_order && slots[b] == b;
  const int64_t bytes = cache.half ? 2 : 4;
  for (int64_t b = 0; b < (in_order ? 1 : rows); ++b) {
    const int64_t offset = (in_order ? 0 : slots[b]) * cache.key_strides[0] * bytes;
    attend(q + b * width * QD, static_cast<const char*>(cache.keys) + offset,
           static_cast<const char*>(cache.values) + offset, cache.half, mask + b * width * capacity, w.scale,
           in_order ? rows : 1, width, w.heads, w.dim, w.kv_heads, capacity, attended + b * width * QD);
  }
  product(attended, M, QD, w.o, w.o_groups, projected);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < H; ++j) out[m * H + j] = h[m * H + j] + projected[m * o_n + j];
  rms_norm(out, w.post_norm, M, H, w.post_eps, normed);
  product(normed, M, H, w.gate_up, w.gate_up_groups, gate_up);
  silu_mul(gate_up, M, w.inner, gate_up_n, act);
  product(act, M, w.inner, w.down, w.down_groups, projected);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < H; ++j) out[m * H + j] += projected[m * down_n + j];
}

}  // namespace fuzzyspec
