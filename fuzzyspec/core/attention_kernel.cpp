// Attention over a static cache, one query at a time, by the same operations whatever else is in the pass
// (attention.py says why). For query t of row b and head h (kv head h / (H / KVH)):
//
//     visit the positions c_1 < c_2 < ... < c_n that mask[b, 0, t] allows, in increasing order;
//     s_i = scale (q . k[c_i]),  m = max_i s_i,  p_i = e^(s_i - m),  out = (sum_i p_i v[c_i]) / (sum_i p_i).
//
// Each number is made by a fixed sequence of operations on what the query sees: a score's dot product by the same
// lanes and tree of additions whichever of 8 keys scored together it is (a last group is filled with zero keys),
// the sums over i in the order of i. So a query's result depends only on the sequence of keys and values it sees,
// not on where they lie in the cache, how many other queries, heads or rows the pass holds, or how threads split
// them. Vectors are 8 floats (AVX2 and FMA), with independent chains of multiply-adds where the order allows
// (8 keys' dot products; 8 dimensions' weighted sums of values), and -ffp-contract=off (kernels.py), so the
// compiler fuses nothing on its own. Tasks (row, query, kv head) are split among torch's threads.
// The headers used, not ATen/ATen.h: it took 7 of the 9 s a first use spent building these kernels.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
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

// Lane j: the sum of the 8 lanes of a[j], by the same tree of additions for every j.
inline __m256 sums8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// out[d] = (sum_i p_i v_i[d]) / total for CH chunks of 8 dimensions from d0: each chunk's sum runs over i in order,
// the CH chunks side by side (independent chains of multiply-adds, so they do not wait on one another).
template <int CH>
void weigh_values(const float* p, int64_t n, const float* const* rows, int64_t d0, float total, float* out) {
  __m256 acc[CH];
  for (int c = 0; c < CH; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const __m256 w = _mm256_set1_ps(p[i]);
    const float* v = rows[i] + d0;
    for (int c = 0; c < CH; ++c) acc[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * c), acc[c]);
  }
  for (int c = 0; c < CH; ++c) _mm256_storeu_ps(out + d0 + 8 * c, _mm256_div_ps(acc[c], _mm256_set1_ps(total)));
}

at::Tensor attend(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& mask,
                  double scale) {
  TORCH_CHECK(query.dim() == 4 && keys.dim() == 4 && values.sizes() == keys.sizes() && mask.dim() == 4,
              "attend: query [B, W, H, D], keys and values [B, KVH, C, D], mask [B, 1, W, C]");
  TORCH_CHECK(query.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat &&
              values.scalar_type() == at::kFloat && mask.scalar_type() == at::kBool,
              "attend: float32 query, keys and values, and a bool mask");
  const at::Tensor q = query.contiguous(), k = keys.contiguous(), v = values.contiguous(), allowed = mask.contiguous();
  const int64_t B = q.size(0), W = q.size(1), H = q.size(2), D = q.size(3), KVH = k.size(1), C = k.size(2);
  TORCH_CHECK(k.size(0) >= B && k.size(3) == D && H % KVH == 0 && allowed.size(0) == B && allowed.size(2) == W &&
              allowed.size(3) == C, "attend: shapes disagree");
  at::Tensor out = at::empty_like(q);
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const bool* mp = allowed.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  const int64_t G = H / KVH, D8 = D - D % 8;
  // A task: one query of one row, against one kv head, for each of the query heads that share it.
  at::parallel_for(0, B * W * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<const float*> seen(C + 8), rows(C);  // the keys and values a query sees
    std::vector<float> weight(C + 8), zeros(D, 0.0f);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task % KVH, bw = task / KVH, b = bw / W;
      const int64_t head = (b * KVH + g) * C * D;
      const bool* allows = mp + bw * C;
      int64_t n = 0;
      for (int64_t c = 0; c < C; ++c)
        if (allows[c]) {
          rows[n] = vp + head + c * D;
          seen[n++] = kp + head + c * D;
        }
      for (int64_t i = n; i < n + 8; ++i) seen[i] = zeros.data();  // a last group of 8 keys is filled with zeros
      for (int64_t h = g * G; h < (g + 1) * G; ++h) {
        const float* qv = qp + (bw * H + h) * D;
        // Scores 8 keys at a time: lane j of acc[j] sums q . k_j over the lanes' dimensions, then sums8.
        for (int64_t i = 0; i < n; i += 8) {
          __m256 acc[8];
          for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
          for (int64_t d = 0; d < D8; d += 8) {
            const __m256 qd = _mm256_loadu_ps(qv + d);
            for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(seen[i + j] + d), acc[j]);
          }
          _mm256_storeu_ps(&weight[i], sums8(acc));
          for (int j = 0; j < 8; ++j) {
            for (int64_t d = D8; d < D; ++d) weight[i + j] += qv[d] * seen[i + j][d];
            weight[i + j] *= s;
          }
        }
        float top = -INFINITY;
        for (int64_t i = 0; i < n; ++i) top = weight[i] > top ? weight[i] : top;
        const __m256 shift = _mm256_set1_ps(top);  // (the last 8 lanes may run past n: never summed)
        for (int64_t i = 0; i < n; i += 8)
          _mm256_storeu_ps(&weight[i], exp8(_mm256_sub_ps(_mm256_loadu_ps(&weight[i]), shift)));
        float total = 0.0f;
        for (int64_t i = 0; i < n; ++i) total += weight[i];
        float* o = op + (bw * H + h) * D;
        for (int64_t d0 = 0; d0 < D8; d0 += 64) {
          switch (std::min<int64_t>(8, (D8 - d0) / 8)) {
            case 8: weigh_values<8>(weight.data(), n, rows.data(), d0, total, o); break;
            case 7: weigh_values<7>(weight.data(), n, rows.data(), d0, total, o); break;
            case 6: weigh_values<6>(weight.data(), n, rows.data(), d0, total, o); break;
            case 5: weigh_values<5>(weight.data(), n, rows.data(), d0, total, o); break;
            case 4: weigh_values<4>(weight.data(), n, rows.data(), d0, total, o); break;
            case 3: weigh_values<3>(weight.data(), n, rows.data(), d0, total, o); break;
            case 2: weigh_values<2>(weight.data(), n, rows.data(), d0, total, o); break;
            case 1: weigh_values<1>(weight.data(), n, rows.data(), d0, total, o); break;
          }
        }
        for (int64_t d = D8; d < D; ++d) {
          float acc = 0.0f;
          for (int64_t i = 0; i < n; ++i) acc += weight[i] * rows[i][d];
          o[d] = acc / total;
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(fuzzyspec_attention, m) { m.def("attend(Tensor query, Tensor keys, Tensor values, Tensor mask, float scale) -> Tensor"); }

TORCH_LIBRARY_IMPL(fuzzyspec_attention, CPU, m) { m.impl("attend", &attend); }
