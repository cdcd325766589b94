// The CPU kernels over plain arrays: what int4_kernel.cpp and layer_kernel.cpp compute, called by ops.cpp, which
// checks torch's tensors, makes the outputs and registers the ops. The kernels' files include none of torch's
// headers: a file with torch's tensor and op-registration headers took about 4.3 s of a first use's build on 2 cores
// before any code of ours, so those are parsed once (ops.cpp), not in every file; and torch's parallel loop is called
// through its stable C ABI (below), where ATen/Parallel.h cost each file about 0.8 s.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <stdexcept>

// torch's stable C ABI (torch 2.10 or later; torch/csrc/stable/c/shim.h): at::parallel_for on torch's threads,
// body(begin, end, context) a range each; nonzero where a body threw.
extern "C" int32_t torch_parallel_for(int64_t begin, int64_t end, int64_t grain_size,
                                      void (*body)(int64_t, int64_t, void*), void* context);

namespace fuzzyspec {

// body(begin, end) over [begin, end) split among torch's threads, ranges of at least grain (as at::parallel_for).
// The first exception a range throws is thrown again here, as it was (through the C ABI only a code would come back).
template <class Body>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const Body& body) {
  struct Run {
    const Body& body;
    std::atomic<bool> failed{false};
    std::exception_ptr error;
  } run{body};
  auto call = [](int64_t from, int64_t to, void* context) {
    Run& run = *static_cast<Run*>(context);
    try {
      run.body(from, to);
    } catch (...) {
      if (!run.failed.exchange(true)) run.error = std::current_exception();
    }
  };
  const int32_t code = torch_parallel_for(begin, end, grain, call, &run);
  if (run.error) std::rethrow_exception(run.error);
  if (code != 0) throw std::runtime_error("fuzzyspec: a CPU kernel failed on one of torch's threads");
}

// int4_kernel.cpp: x [M, K] float32 times a packed weight's transpose (groups of 16 rows, blocks of 32 inputs,
// Q4_BYTES or Q8_BYTES a group and block; the layout is described there): out [M, groups * 16] float32.
constexpr int64_t ROWS = 16;
constexpr int64_t Q4_BYTES = 4 * 64 + 16 * 2 + 16 * 2;  // codes, float16 scales, float16 minimums
// Q8: codes and float16 scales, then, for the AVX-512 build alone, the rows' int32 code sums, which its products
// take back off (they read the activations shifted to unsigned). The other builds never read them, and without them
// an 8-bit LM head's product streams 11% fewer bytes (int4.py packs what this build reads: ``q8_sums``).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
constexpr int64_t Q8_BYTES = 8 * 64 + 16 * 2 + 16 * 4;
#else
constexpr int64_t Q8_BYTES = 8 * 64 + 16 * 2;
#endif
void product_q4(const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t groups, float* out);
void product_q8(const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t groups, float* out);
// Each of logits' M rows [M, N]: its k highest worked out again as x[m] . weight[ids[j]] (x [M, K], weight [V, K]).
void top_again(float* logits, int64_t M, int64_t N, const float* x, int64_t K, const float* weight,
               const int64_t* ids, int64_t k);

// layer_kernel.cpp. Keys and values are float32, or float16 (``half``: their bits).
// out [B, W, H, D] = attention of q [B, W, H, D] over keys and values [>= B, KVH, C, D] where mask [B, 1, W, C].
void attend(const float* q, const void* keys, const void* values, bool half, const bool* mask, float scale,
            int64_t B, int64_t W, int64_t H, int64_t D, int64_t KVH, int64_t C, float* out);
// dst [rows, size] = weight * (src / sqrt(mean(src^2) + eps)) per row.
void rms_norm(const float* src, const float* weight, int64_t rows, int64_t size, float eps, float* dst);
// The rotary embedding of q, k [rows * width tokens, heads (kv_heads) * dim] by cos, sin [tokens, dim], q's into
// q_out [tokens, heads, dim], k's and v's into keys and values (strides in elements) at slot slots[b] and position
// positions[token]. q's, k's and v's tokens lie token_strides[0], [1] and [2] floats apart (views of one fused
// projection's output are read where they are).
struct Cache {
  void* keys;
  void* values;
  bool half;
  int64_t key_strides[4], value_strides[4];
};
void rope_store(const float* q, const float* k, const float* v, const int64_t* token_strides, const float* cos,
                const float* sin, const Cache& cache, const int64_t* slots, const int64_t* positions, int64_t rows,
                int64_t width, int64_t heads, int64_t kv_heads, int64_t dim, float* q_out);
// In one slot of a cache tensor (``row``: its first byte; heads of ``head_stride`` bytes, positions of
// ``position_stride`` bytes, each ``bytes`` long), position start + columns[i] moved to start + i.
void keep_columns(char* row, int64_t heads, int64_t head_stride, int64_t position_stride, int64_t bytes,
                  int64_t start, const int64_t* columns, int64_t count);
// out [rows, inner] = silu(gate) * up, where each of the rows holds gate (its first ``inner`` floats) and up (the
// next ``inner``), rows ``stride`` floats apart (a fused gate|up product's output).
void silu_mul(const float* gate_up, int64_t rows, int64_t inner, int64_t stride, float* out);

// A Llama-family decoder layer whole: its norms' float32 weights (no input norm where input_norm is null: an EAGLE
// head's), its projections packed for product_q4, or product_q8 where ``eight`` (q|k|v fused, and gate|up), and
// its shape.
struct Layer {
  const float *input_norm, *post_norm;
  float input_eps, post_eps;
  bool eight;
  const uint8_t *qkv, *o, *gate_up, *down;
  int64_t qkv_groups, o_groups, gate_up_groups, down_groups;
  int64_t hidden, inner, heads, kv_heads, dim;
  float scale;  // attention's
};
// out [rows, width, hidden] = the layer over h [rows, width, hidden], in one call where eager PyTorch made about
// twenty: the same kernels as the separate ops, in the same order, so the same numbers. Its keys and values go into
// the cache (contiguous [slots, kv_heads, capacity, D]) at slot slots[b] and position positions[b * width + t], and
// attention reads slot slots[b] where mask [rows, 1, width, capacity] allows; cos, sin [rows, width, 1, D].
void decoder_layer(const float* h, const Layer& layer, const float* cos, const float* sin, const Cache& cache,
                   int64_t capacity, const bool* mask, const int64_t* slots, const int64_t* positions, int64_t rows,
                   int64_t width, float* out);

}  // namespace fuzzyspec
