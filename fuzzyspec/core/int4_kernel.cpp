// Products of activations with llama.cpp's 4-bit and 8-bit weight blocks on an x86 CPU: AVX2, AVX2 with
// AVX-VNNI, or AVX-512 with VNNI, as the build enables (int4.py picks the flags per machine); and, for a draft's
// logits over 4-bit rows, each output's few highest worked out again from float rows (top_again, at the end).
//
// A weight row is blocks of 32 inputs, each with a float16 scale d (and, Q4, a minimum m): w = d q + m with
// Q4 codes q in 0..15, w = d q with Q8 codes q in -128..127. As llama.cpp does, each token's activations are
// first rounded to 8 bits per block of 32 (a float scale e = max|x| / 127 and codes a = round(x / e)), so a
// block's product is one integer dot product:
//
//     y[t, n] = sum_b  d[n, b] e[t, b] (q[n, b] . a[t, b])  +  m[n, b] e[t, b] sum(a[t, b])
//
// Layout (int4.py packs it): rows in groups of 16, and per group and block, for j = 0..3 (Q4) or 0..7 (Q8),
// 64 bytes holding four consecutive codes of each of the 16 rows (Q4: inputs 4j..4j+3 in the low nibbles,
// 16+4j.. in the high ones), then the 16 rows' float16 scales (and Q4's float16 minimums; the AVX-512 build's
// Q8, the rows' int32 code sums). So one vector register holds the same four inputs of 16 rows (8 with AVX2),
// the token's four activation bytes are broadcast to every lane, and one multiply-add of bytes (VNNI's dpbusd,
// or AVX2's maddubs + madd) advances 16 rows' integer sums at once: no horizontal sums, and the float work
// (convert, scale, accumulate) is done once per block for 16 rows.
//
// Unsigned by signed bytes: Q4's codes are unsigned. Q8's are signed: AVX2 gives their signs to the
// activations (pair sums stay below int16's limit, 2 * 128 * 127); AVX-512 shifts the activations to unsigned
// (a + 128, once per product) and takes 128 sum(q) back off.
//
// Threads (torch's parallel loop, kernels.h) take groups of 16 rows. Every output is computed by the
// same sequence of operations whatever the number of tokens and rows around it (no multiply-adds fused by the
// compiler: -ffp-contract=off), so a token's result does not depend on its batch: a verification step gives
// the logits a single step would.
// Over plain arrays (kernels.h): ops.cpp checks the tensors and registers the ops.
#include "kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using fuzzyspec::ROWS;  // weight rows per packed group

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// Rows of x [M, K] -> int8 codes [M, K], block scales e [M, K/32] and e * sum(codes) [M, K/32].
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
    __m256i total = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i * 32), _mm256_permutevar8x32_epi32(bytes, order));
    total = _mm256_hadd_epi32(total, total);
    total = _mm256_hadd_epi32(total, total);
    scale[i] = e;
    scaled_sum[i] = e * static_cast<float>(_mm256_extract_epi32(total, 0) + _mm256_extract_epi32(total, 4));
  }
}

struct Operands {
  const uint8_t* packed;  // [N / 16, blocks, Format::bytes]
  const int8_t* x;        // activation codes [M, K]
  const float* x_scale;   // [M, blocks]
  const float* x_sum;     // [M, blocks]
  float* out;             // [M, N]
  int64_t blocks, N;
};

// Activations 4j..4j+3 of a block, as one lane's worth: read through a type that may alias the bytes, so a
// broadcast of them loads from memory (copied through an integer register, as memcpy had it, it cost an
// instruction more).
typedef int32_t bytes4 __attribute__((may_alias, aligned(1)));
inline int32_t four_bytes(const int8_t* p) { return *reinterpret_cast<const bytes4*>(p); }

struct Four {  // Q4_0 / Q4_1
  static constexpr int64_t bytes = fuzzyspec::Q4_BYTES;
};

struct Eight {  // Q8_0
  static constexpr int64_t bytes = fuzzyspec::Q8_BYTES;
};

// A model's weights are larger than the caches, so each product streams them from memory, and the hardware's own
// prefetching falls behind it: every tile asks for the bytes PREFETCH ahead of the block it reads. A tile walks
// its group's blocks in order and a thread its groups in order, so 8 KB ahead is one to two groups ahead in the
// same stream. On the 2-core AMD EPYC, a whole model's products (30 layers' distinct weights and the head) ran
// 1.02-1.07x faster at 1 token, 1.05-1.14x at 2-4 and 1.14-1.25x at 6-17 than asking 1 KB ahead from 4 tokens on
// (as before), and the AVX2 build (emulated there) 1.27x at 1 token and 1.07-1.16x at 2-17 than not asking; 4-12 KB
// measured alike, 0.5-2 KB less well. (With a weight already in the caches, as a tree's later levels find the
// EAGLE head's, the requests cost the AVX2 build's tiles of 4-17 tokens 5-9%, the AVX-512 build's about 1%.)
constexpr int64_t PREFETCH = 8192;

template <class Format>
inline void prefetch(const uint8_t* block) {
  for (int64_t line = 0; line < Format::bytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(block + PREFETCH + line), _MM_HINT_T0);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)

// acc + the products of u's unsigned bytes by the four signed bytes at a, broadcast to every lane, as one
// instruction that reads them from memory ({1to16}). GCC broadcasts them into a register first, an instruction
// more per multiply-add: at 2-17 tokens the 4-bit products ran 5-9% faster this way (the same integers).
inline __m512i dpbusd_broadcast(__m512i acc, __m512i u, const int8_t* a) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*reinterpret_cast<const bytes4*>(a)));
  return acc;
}

constexpr int TILE = 8;  // tokens a tile takes at most: its weights are unpacked once for all of them
// Q8's tiles read the activations' codes shifted to unsigned (a + 128, bytewise), once for all its products
constexpr bool Q8_SHIFTED = true;

// One group of 16 rows against tokens t .. t + TN - 1. A token's integer sum runs as CHAINS chains, added
// exactly: a lone token's four (codes j and j + 4 apart) give its multiply-adds independent work without
// reading a second group (two groups' streams at once measured 18% slower decoding on an AMD EPYC); with more
// tokens their sums are that work, and each chain more costs an add a block per token.
template <int TN>
void tile(const Operands& o, Four, int64_t g, int64_t t) {
  constexpr int CHAINS = TN >= 4 ? 1 : TN >= 2 ? 2 : 4;
  const int64_t nb = o.blocks;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[TN];
  for (int i = 0; i < TN; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = o.packed + (g * nb + b) * Four::bytes;
    prefetch<Four>(p);
    __m512i w[8];  // w[j]: codes 4j..4j+3 (j < 4), 16 + 4(j - 4).. (j >= 4) of the 16 rows
    for (int j = 0; j < 4; ++j) {
      const __m512i raw = _mm512_loadu_si512(p + 64 * j);
      w[j] = _mm512_and_si512(raw, low);
      w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 256)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 288)));
    for (int i = 0; i < TN; ++i) {
      const int64_t block = (t + i) * nb + b;
      const int8_t* a = o.x + block * 32;
      __m512i s[CHAINS];
      for (int j = 0; j < CHAINS; ++j) s[j] = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j)
        s[j % CHAINS] = dpbusd_broadcast(s[j % CHAINS], w[j], a + 4 * j);
      __m512i sum = s[0];
      for (int j = 1; j < CHAINS; ++j) sum = _mm512_add_epi32(sum, s[j]);
      acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(o.x_scale[block])), _mm512_cvtepi32_ps(sum), acc[i]);
      acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(o.x_sum[block]), acc[i]);
    }
  }
  for (int i = 0; i < TN; ++i) _mm512_storeu_ps(o.out + (t + i) * o.N + g * ROWS, acc[i]);
}

template <int TN>
void tile(const Operands& o, Eight, int64_t g, int64_t t) {
  const int64_t nb = o.blocks;
  __m512 acc[TN];
  for (int i = 0; i < TN; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = o.packed + (g * nb + b) * Eight::bytes;
    prefetch<Eight>(p);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 512)));
    const __m512i taken = _mm512_slli_epi32(_mm512_loadu_si512(p + 544), 7);  // 128 sum(q)
    for (int i = 0; i < TN; ++i) {
      const int64_t block = (t + i) * nb + b;
      const int8_t* a = o.x + block * 32;
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {
        s0 = _mm512_dpbusd_epi32(s0, _mm512_set1_epi32(four_bytes(a + 4 * j)), _mm512_loadu_si512(p + 64 * j));
        s1 = _mm512_dpbusd_epi32(s1, _mm512_set1_epi32(four_bytes(a + 16 + 4 * j)), _mm512_loadu_si512(p + 64 * (j + 4)));
      }
      const __m512i exact = _mm512_sub_epi32(_mm512_add_epi32(s0, s1), taken);
      acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(o.x_scale[block])), _mm512_cvtepi32_ps(exact), acc[i]);
    }
  }
  for (int i = 0; i < TN; ++i) _mm512_storeu_ps(o.out + (t + i) * o.N + g * ROWS, acc[i]);
}

#else

// Tokens a tile takes at most. With a pass per half of the group (as the tiles were before the one-pass tiles
// below), 8 ran faster than 4 on the 2-core AMD EPYC (Zen 3), though AVX2's 16 vector registers held a token's sums
// and accumulator for only 6 beside the codes being read: 30 layers' 4-bit products took 0.94-0.96x the time at 6
// tokens, 0.76-0.83x at 8, 0.92-0.94x at 12 and 0.82-0.84x at 17, the 8-bit head's 0.92-1.03x at 6-17 (one process,
// the builds taking turns in a rotating order, best and median of 10-20), 1-4 tokens alike; 12 gave part of it back,
// and keeping the sums in the output (no spills) or unrolling the four steps ran 1.1-1.5x slower. A one-pass tile
// holds four registers a token, so 8 spill more; tiles of at most 6 or 7 ran within 10% of 8 either way at 1-17
// tokens, and 8 stayed. AVX-VNNI's two chains a token need more registers still, and no such machine has measured
// a wider tile: it keeps 4.
#if defined(__AVXVNNI__)
constexpr int TILE = 4;
#else
constexpr int TILE = 8;
#endif
constexpr bool Q8_SHIFTED = false;

// Eight int32 sums of four products of unsigned by signed bytes, added to acc: one instruction with AVX-VNNI,
// else AVX2's pairs to int16 (maddubs) and pairs of those to int32 (madd). The same integers either way.
inline __m256i accumulate(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// A Q4 block's eight int32 sums, a step of four inputs' low-nibble codes and one's high-nibble codes at a time.
// Without VNNI they stay as int16 pairs (maddubs) until the block ends and widen once (madd): a pair of a code
// (0..15) and an activation (-127..127) is at most 3,810 in size, eight steps' 30,480, inside int16, so the sums
// are the same integers as widened step by step, for a third fewer instructions. (Q8's signed pairs reach
// 32,512: they widen every step.) With VNNI, two chains, so a lone token's multiply-adds do not wait in one line.
struct Q4Sums {
#if defined(__AVXVNNI__)
  __m256i low = _mm256_setzero_si256(), high = _mm256_setzero_si256();
  void add(__m256i lo, __m256i a_lo, __m256i hi, __m256i a_hi) {
    low = _mm256_dpbusd_avx_epi32(low, lo, a_lo);
    high = _mm256_dpbusd_avx_epi32(high, hi, a_hi);
  }
  __m256i total() const { return _mm256_add_epi32(low, high); }
#else
  __m256i pairs = _mm256_setzero_si256();
  void add(__m256i lo, __m256i a_lo, __m256i hi, __m256i a_hi) {
    pairs = _mm256_add_epi16(pairs, _mm256_add_epi16(_mm256_maddubs_epi16(lo, a_lo), _mm256_maddubs_epi16(hi, a_hi)));
  }
  __m256i total() const { return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)); }
#endif
};

inline __m256i broadcast(const int8_t* a) { return _mm256_set1_epi32(four_bytes(a)); }

// As the AVX-512 tiles, with the group as two halves of 8 rows, both in one pass: each step's codes are read and
// unpacked once for every token of the tile (steps outside, tokens inside), and each token's activations are
// broadcast once for both halves. Against a pass per half, which broadcast them twice but held half the sums, a
// model's products (30 layers' 4-bit weights, the builds taking turns in a rotating order, best and median of 20)
// took 0.95-0.98x the time at 1 token, 0.86-0.91x at 2-3, 0.73-0.83x at 4, 0.71-0.77x at 6 and 0.90-1.07x at 8-17.
template <int TN>
void tile(const Operands& o, Four, int64_t g, int64_t t) {
  const int64_t nb = o.blocks;
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[TN][2];
  for (int i = 0; i < TN; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = o.packed + (g * nb + b) * Four::bytes;
    prefetch<Four>(p);
    const int8_t* a = o.x + (t * nb + b) * 32;  // token t + i's block: a + i * K
    const int64_t K = nb * 32;
    Q4Sums sums[TN][2];
    for (int j = 0; j < 4; ++j) {  // codes 4j..4j+3 in the low nibbles, 16 + 4j.. in the high ones
      __m256i lo[2], hi[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * j + 32 * h));
        lo[h] = _mm256_and_si256(raw, low);
        hi[h] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
      }
      for (int i = 0; i < TN; ++i) {
        const __m256i a_lo = broadcast(a + i * K + 4 * j), a_hi = broadcast(a + i * K + 16 + 4 * j);
        for (int h = 0; h < 2; ++h) sums[i][h].add(lo[h], a_lo, hi[h], a_hi);
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 256 + 16 * h)));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 288 + 16 * h)));
      for (int i = 0; i < TN; ++i) {
        const int64_t block = (t + i) * nb + b;
        const __m256 products = _mm256_cvtepi32_ps(sums[i][h].total());
        acc[i][h] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(o.x_scale[block])), products, acc[i][h]);
        acc[i][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(o.x_sum[block]), acc[i][h]);
      }
    }
  }
  for (int i = 0; i < TN; ++i)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(o.out + (t + i) * o.N + g * ROWS + 8 * h, acc[i][h]);
}

// Q8 as Q4, both halves in one pass: the 8-bit head's products (49,152 x 576) took 0.85-0.91x the time of a pass per
// half at 1-4 tokens and 0.86-1.02x at 6-17 (measured as the Q4 tile was).
template <int TN>
void tile(const Operands& o, Eight, int64_t g, int64_t t) {
  const int64_t nb = o.blocks;
  __m256 acc[TN][2];
  for (int i = 0; i < TN; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = o.packed + (g * nb + b) * Eight::bytes;
    prefetch<Eight>(p);
    const int8_t* a = o.x + (t * nb + b) * 32;
    const int64_t K = nb * 32;
    __m256i sums[TN][2];
    for (int i = 0; i < TN; ++i) sums[i][0] = sums[i][1] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {  // signed codes: their magnitudes times the activations given their signs
      __m256i w[2], magnitude[2];
      for (int h = 0; h < 2; ++h) {
        w[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * j + 32 * h));
        magnitude[h] = _mm256_sign_epi8(w[h], w[h]);
      }
      for (int i = 0; i < TN; ++i) {
        const __m256i x = broadcast(a + i * K + 4 * j);
        for (int h = 0; h < 2; ++h) sums[i][h] = accumulate(sums[i][h], magnitude[h], _mm256_sign_epi8(x, w[h]));
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 512 + 16 * h)));
      for (int i = 0; i < TN; ++i) {
        const int64_t block = (t + i) * nb + b;
        const __m256 products = _mm256_cvtepi32_ps(sums[i][h]);
        acc[i][h] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(o.x_scale[block])), products, acc[i][h]);
      }
    }
  }
  for (int i = 0; i < TN; ++i)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(o.out + (t + i) * o.N + g * ROWS + 8 * h, acc[i][h]);
}

#endif

// The last n < TILE tokens from t, as one tile.
template <class Format, int TN>
void rest(const Operands& o, int64_t g, int64_t t, int64_t n) {
  if constexpr (TN > 0) {
    if (n == TN)
      tile<TN>(o, Format{}, g, t);
    else
      rest<Format, TN - 1>(o, g, t, n);
  }
}

// One group against every token: TILE at a time, then the rest.
template <class Format>
void group(const Operands& o, int64_t g, int64_t M) {
  int64_t t = 0;
  for (; t + TILE <= M; t += TILE) tile<TILE>(o, Format{}, g, t);
  rest<Format, TILE - 1>(o, g, t, M - t);
}

// x [M, K] times the packed weight's transpose: out [M, N] (N = 16 x groups), float32.
template <class Format>
void product(const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t G, float* out) {
  const int64_t nb = K / 32, N = G * ROWS;
  if (M == 0 || N == 0) return;
  std::vector<int8_t> xq(M * K);
  std::vector<float> x_scale(M * nb), x_sum(M * nb);
  quantize(x, M * nb, xq.data(), x_scale.data(), x_sum.data());
  if constexpr (std::is_same_v<Format, Eight> && Q8_SHIFTED)
    for (int8_t& code : xq) code = static_cast<int8_t>(static_cast<uint8_t>(code) ^ 0x80u);
  const Operands o{packed, xq.data(), x_scale.data(), x_sum.data(), out, nb, N};
  fuzzyspec::parallel_for(0, G, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) group<Format>(o, g, M);
  });
}

// x . w over K floats, 8 lanes at a time.
float dot(const float* x, const float* w, int64_t K) {
  __m256 sum = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= K; i += 8) sum = _mm256_add_ps(sum, _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(w + i)));
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  float total = _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
  for (; i < K; ++i) total += x[i] * w[i];
  return total;
}

}  // namespace

namespace fuzzyspec {

void product_q4(const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t groups, float* out) {
  product<Four>(x, M, K, packed, groups, out);
}

void product_q8(const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t groups, float* out) {
  product<Eight>(x, M, K, packed, groups, out);
}

// Each row's k highest logits worked out again from float weight rows (RoundedRows in vocab.py): logits [M, N]
// (a product over 4-bit rows, rewritten in place), x [M, K] its inputs, weight [V, K] the float rows, ids [N] the
// weight row of each logit. A row's k highest are found in one pass, 8 values at a time against the least of a
// sorted list of k, which a value enters only where it beats that least (after the first few hundred values,
// seldom); then each is x . weight[ids[j]].
void top_again(float* all, int64_t M, int64_t N, const float* inputs, int64_t K, const float* rows,
               const int64_t* row_of, int64_t k) {
  k = std::min(k, N);
  if (k <= 0) return;
  std::vector<float> best(k);
  std::vector<int64_t> where(k);
  for (int64_t m = 0; m < M; ++m) {
    float* row = all + m * N;
    int64_t held = 0;
    float least = -INFINITY;  // what a value must beat to enter (-inf until k are held)
    auto enter = [&](float value, int64_t j) {
      if (!(value > least)) return;
      int64_t p = held < k ? held++ : k - 1;
      for (; p > 0 && best[p - 1] < value; --p) {
        best[p] = best[p - 1];
        where[p] = where[p - 1];
      }
      best[p] = value;
      where[p] = j;
      if (held == k) least = best[k - 1];
    };
    int64_t j = 0;
    for (; j + 8 <= N; j += 8) {
      int above = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + j), _mm256_set1_ps(least), _CMP_GT_OQ));
      for (; above; above &= above - 1) enter(row[j + __builtin_ctz(above)], j + __builtin_ctz(above));
    }
    for (; j < N; ++j) enter(row[j], j);
    for (int64_t i = 0; i < held; ++i) row[where[i]] = dot(inputs + m * K, rows + row_of[where[i]] * K, K);
  }
}

}  // namespace fuzzyspec
