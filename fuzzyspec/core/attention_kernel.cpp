// Attention over a static cache, one query at a time, by the same operations whatever else is in the pass
// (attention.py says why). For query t of row b and head h (kv head h / (H / KVH)):
//
//     visit the positions c = c_1 < c_2 < ... < c_n that mask[b, 0, t] allows, in increasing order;
//     s_i = scale (q . k[c_i]),  m = max_i s_i,  p_i = e^(s_i - m),  out = (sum_i p_i v[c_i]) / (sum_i p_i),
//
// every sum taken in the order of i (a dot product over the head's D dimensions in 8 lanes, then the lanes in a
// fixed order). So a query's result depends only on the sequence of keys and values it sees, not on where they
// lie in the cache, how many other queries, heads or rows the pass holds, or how threads split them.
// Tasks (row, query, head) are split among torch's threads (at::parallel_for); AVX2 and FMA, with
// -ffp-contract=off (kernels.py), so the compiler fuses nothing on its own.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <vector>

namespace {

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

inline float dot(const float* a, const float* b, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  float total = _mm_cvtss_f32(s);
  for (; d < D; ++d) total += a[d] * b[d];
  return total;
}

at::Tensor attend(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& mask,
                  double scale) {
  TORCH_CHECK(query.dim() == 4 && keys.dim() == 4 && values.sizes() == keys.sizes() && mask.dim() == 4,
              "attend: query [B, W, H, D], keys and values [B, KVH, C, D], mask [B, 1, W, C]");
  TORCH_CHECK(query.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat &&
              values.scalar_type() == at::kFloat && mask.scalar_type() == at::kBool, "attend: float32 query, keys and values, and a bool mask");
  const at::Tensor q = query.contiguous(), k = keys.contiguous(), v = values.contiguous(), allowed = mask.contiguous();
  const int64_t B = q.size(0), W = q.size(1), H = q.size(2), D = q.size(3), KVH = k.size(1), C = k.size(2);
  TORCH_CHECK(k.size(0) >= B && k.size(3) == D && H % KVH == 0 && allowed.size(0) == B && allowed.size(2) == W &&
              allowed.size(3) == C, "attend: shapes disagree");
  at::Tensor out = at::empty_like(q);
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const bool* mp = allowed.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  at::parallel_for(0, B * W * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> seen(C);
    std::vector<float> weight(C + 8);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task % H, bw = task / H, b = bw / W;
      const float* qv = qp + task * D;
      const int64_t head = (b * KVH + h / (H / KVH)) * C * D;
      const bool* row = mp + bw * C;
      int64_t n = 0;
      for (int64_t c = 0; c < C; ++c)
        if (row[c]) seen[n++] = static_cast<int32_t>(c);
      float top = -INFINITY;
      for (int64_t i = 0; i < n; ++i) {
        weight[i] = dot(qv, kp + head + seen[i] * D, D) * s;
        top = weight[i] > top ? weight[i] : top;
      }
      const __m256 shift = _mm256_set1_ps(top);  // (the last 8 lanes may run past n: never summed)
      for (int64_t i = 0; i < n; i += 8)
        _mm256_storeu_ps(&weight[i], exp8(_mm256_sub_ps(_mm256_loadu_ps(&weight[i]), shift)));
      float total = 0.0f;
      for (int64_t i = 0; i < n; ++i) total += weight[i];
      float* o = op + task * D;
      int64_t d = 0;
      for (; d + 8 <= D; d += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; ++i)
          acc = _mm256_fmadd_ps(_mm256_set1_ps(weight[i]), _mm256_loadu_ps(vp + head + seen[i] * D + d), acc);
        _mm256_storeu_ps(o + d, _mm256_div_ps(acc, _mm256_set1_ps(total)));
      }
      for (; d < D; ++d) {
        float acc = 0.0f;
        for (int64_t i = 0; i < n; ++i) acc += weight[i] * vp[head + seen[i] * D + d];
        o[d] = acc / total;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(fuzzyspec_attention, m) { m.def("attend(Tensor query, Tensor keys, Tensor values, Tensor mask, float scale) -> Tensor"); }

TORCH_LIBRARY_IMPL(fuzzyspec_attention, CPU, m) { m.impl("attend", &attend); }
