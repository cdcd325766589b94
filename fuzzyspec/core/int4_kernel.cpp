// Products of activations with llama.cpp's own 4-bit and 8-bit weight blocks on an AVX2 CPU.
//
// A weight row is blocks of 32 inputs. Q4 (Q4_0, Q4_1): 16 bytes of codes q in 0..15 (element j is the low
// nibble of byte j, element j + 16 its high nibble) with a float16 scale d and minimum m: w = d q + m.
// Q8 (Q8_0): 32 int8 codes with a float16 scale d: w = d q.
//
// As llama.cpp does, each token's activations are first rounded to 8 bits per block of 32 (a float scale
// e = max|x| / 127 and codes a = round(x / e)), so a block's product is one integer dot product:
//
//     y[t, n] = sum_b  d[n, b] e[t, b] (q[n, b] . a[t, b])  +  m[n, b] e[t, b] sum(a[t, b])
//
// AVX2 multiplies unsigned by signed bytes (maddubs), which Q4's codes are; Q8's signed codes give their
// sign to the activations instead. Pair sums stay below int16's limit (2 * 128 * 127).
//
// Threads (at::parallel_for, torch's OpenMP pool) take tiles of four weight rows.
//
// Every output is computed by the same sequence of float operations whatever the number of tokens and
// rows around it (no fused multiply-adds chosen by the compiler: -ffp-contract=off), so a token's result
// does not depend on the batch it came in: a verification step gives the logits a single step would.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <vector>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// Rows of x [M, K] -> int8 codes [M, K], block scales e [M, K/32, 8] (each written 8 times, as the vector the
// products multiply by) and e * sum(codes) [M, K/32].
void quantize(const float* x, int64_t blocks, int8_t* codes, float* scale, float* scaled_sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleaving
  for (int64_t i = 0; i < blocks; ++i) {
    const float* xb = x + i * 32;
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 32; j += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + j)));
    const float e = hmax(amax) / 127.0f;
    const __m256 inverse = _mm256_set1_ps(e > 0 ? 1.0f / e : 0.0f);
    __m256i c[4];
    for (int j = 0; j < 4; ++j)
      c[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * j), inverse),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i * 32), _mm256_permutevar8x32_epi32(bytes, order));
    _mm256_storeu_ps(scale + i * 8, _mm256_set1_ps(e));
    scaled_sum[i] = e * hsum(_mm256_cvtepi32_ps(total));
  }
}

// float16 -> float32, 8 at a time.
void widen(const at::Half* h, int64_t n, float* f) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  for (; i < n; ++i) f[i] = _cvtsh_ss(h[i].x);
}

float dot(const float* u, const float* v, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(u + i), _mm256_loadu_ps(v + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += u[i] * v[i];
  return s;
}

// ``rows_at_once``: how many rows one token's product reads together (measured: four 4-bit rows, one 8-bit row).
struct Four {  // Q4: unsigned codes, multiplied as they are
  static constexpr int64_t bytes = 16;
  static constexpr int rows_at_once = 4;
  static __m256i load(const uint8_t* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
  }
  static __m256i pairs(__m256i w, __m256i a) { return _mm256_maddubs_epi16(w, a); }
};

struct Eight {  // Q8: signed codes, whose signs move to the activations
  static constexpr int64_t bytes = 32;
  static constexpr int rows_at_once = 1;
  static __m256i load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static __m256i pairs(__m256i w, __m256i a) {
    return _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
  }
};

struct Operands {
  const uint8_t* codes;                       // weight codes [N, blocks * Format::bytes]
  const at::Half* scales;                     // [N, blocks]
  const at::Half* minimums;                   // [N, blocks], or null (Q8)
  const int8_t* x;                            // activation codes [M, K]
  const float* x_scale;                       // [M, blocks, 8]
  const float* x_sum;                         // [M, blocks]
  float* out;                                 // [M, N]
  int64_t blocks, N;
};

constexpr int64_t MAX_BLOCKS = 1024;  // inputs up to 32768

// Outputs of RN weight rows from n on, for TN tokens from t on.
template <class Format, int RN, int TN>
void tile(const Operands& o, int64_t n, int64_t t) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t nb = o.blocks;
  float scale[RN][MAX_BLOCKS];
  for (int r = 0; r < RN; ++r) widen(o.scales + (n + r) * nb, nb, scale[r]);
  __m256 acc[RN][TN];
  for (int r = 0; r < RN; ++r)
    for (int i = 0; i < TN; ++i) acc[r][i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i w[RN];
    __m256 d[RN];
    for (int r = 0; r < RN; ++r) {
      w[r] = Format::load(o.codes + ((n + r) * nb + b) * Format::bytes);
      d[r] = _mm256_set1_ps(scale[r][b]);
    }
    for (int i = 0; i < TN; ++i) {
      const int64_t block = (t + i) * nb + b;
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o.x + block * 32));
      const __m256 e = _mm256_loadu_ps(o.x_scale + block * 8);  // the block's scale in every lane
      for (int r = 0; r < RN; ++r) {
        const __m256 products = _mm256_cvtepi32_ps(_mm256_madd_epi16(Format::pairs(w[r], a), ones));
        acc[r][i] = _mm256_fmadd_ps(_mm256_mul_ps(d[r], e), products, acc[r][i]);
      }
    }
  }
  float minimum[MAX_BLOCKS];
  for (int r = 0; r < RN; ++r) {
    if (o.minimums != nullptr) widen(o.minimums + (n + r) * nb, nb, minimum);
    for (int i = 0; i < TN; ++i) {
      const float offset = o.minimums != nullptr ? dot(minimum, o.x_sum + (t + i) * nb, nb) : 0.0f;
      o.out[(t + i) * o.N + n + r] = hsum(acc[r][i]) + offset;
    }
  }
}

// RN rows against every token: four at a time, then the rest.
template <class Format, int RN>
void rows(const Operands& o, int64_t n, int64_t M) {
  int64_t t = 0;
  for (; t + 4 <= M; t += 4) tile<Format, RN, 4>(o, n, t);
  switch (M - t) {
    case 3: tile<Format, RN, 3>(o, n, t); break;
    case 2: tile<Format, RN, 2>(o, n, t); break;
    case 1: tile<Format, RN, 1>(o, n, t); break;
  }
}

// x [..., K] times the weight's transpose: [..., N], in x's dtype (computed in float32).
template <class Format>
at::Tensor product(const at::Tensor& input, const at::Tensor& codes, const at::Tensor& scales,
                   const c10::optional<at::Tensor>& minimums) {
  const int64_t K = input.size(-1), N = codes.size(0), nb = K / 32;
  TORCH_CHECK(K % 32 == 0 && codes.dim() == 2, "inputs in blocks of 32 and a 2-d weight");
  TORCH_CHECK(nb <= MAX_BLOCKS && codes.size(1) == nb * Format::bytes && scales.size(0) == N && scales.size(1) == nb,
              "weight blocks do not match the input size");
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous() && scales.scalar_type() == at::kHalf, "bad weight");
  const at::Tensor x = input.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out.view(shape).to(input.scalar_type());
  std::vector<int8_t> xq(M * K);
  std::vector<float> x_scale(M * nb * 8), x_sum(M * nb);
  quantize(x.data_ptr<float>(), M * nb, xq.data(), x_scale.data(), x_sum.data());
  const at::Half* mins = nullptr;
  if (minimums.has_value()) {
    TORCH_CHECK(minimums->is_contiguous() && minimums->sizes() == scales.sizes() &&
                minimums->scalar_type() == at::kHalf, "bad minimums");
    mins = minimums->data_ptr<at::Half>();
  }
  const Operands o{static_cast<const uint8_t*>(codes.data_ptr()), scales.data_ptr<at::Half>(), mins,
                   xq.data(), x_scale.data(), x_sum.data(), out.data_ptr<float>(), nb, N};
  // Threads take tiles of four rows; one token (decoding) reads Format::rows_at_once rows together, several
  // tokens share two.
  at::parallel_for(0, (N + 3) / 4, 4, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin * 4; n < std::min(end * 4, N); n += 4) {
      if (N - n < 4) {
        for (int64_t r = n; r < N; ++r) rows<Format, 1>(o, r, M);
      } else if (M == 1) {
        constexpr int R = Format::rows_at_once;
        for (int64_t r = n; r < n + 4; r += R) tile<Format, R, 1>(o, r, 0);
      } else {
        rows<Format, 2>(o, n, M);
        rows<Format, 2>(o, n + 2, M);
      }
    }
  });
  return out.view(shape).to(input.scalar_type());
}

at::Tensor mm_q4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& minimums) {
  return product<Four>(x, codes, scales, minimums);
}

at::Tensor mm_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  return product<Eight>(x, codes, scales, c10::nullopt);
}

}  // namespace

TORCH_LIBRARY(fuzzyspec_int4, m) {
  m.def("mm_q4(Tensor x, Tensor codes, Tensor scales, Tensor minimums) -> Tensor");
  m.def("mm_q8(Tensor x, Tensor codes, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(fuzzyspec_int4, CPU, m) {
  m.impl("mm_q4", &mm_q4);
  m.impl("mm_q8", &mm_q8);
}
