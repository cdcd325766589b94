// The CPU kernels as torch ops: each checks its tensors (one line for a wrong shape, dtype or place, before anything
// is written), makes its output, and calls the kernel over plain arrays (kernels.h; int4_kernel.cpp and
// layer_kernel.cpp say what each computes). Written against torch's stable ABI (torch 2.10 or later): its headers
// parse in about 3 s on 2 cores, where ATen's Tensor and torch/library.h took 10 s, the longest part of a first
// use's build. Each of its calls into ATen goes through the dispatcher, so the ops make one only where an input is
// not already as the kernels take it (float32, contiguous), and allocate their outputs through the C shim: a layer
// of the embedded target costs what it did with ATen's headers (137.7 against 136.6 us, the same process).
// No part of the stable ABI newer than torch 2.10 (kernels.MIN_TORCH) is used.
#define TORCH_TARGET_VERSION (((0ULL + 2) << 56) | ((0ULL + 10) << 48))
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <utility>
#include <vector>

#include "kernels.h"

namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// A failed check's one line, as a RuntimeError in Python.
template <typename... Parts>
void check(bool holds, const Parts&... parts) {
  if (holds) return;
  std::ostringstream message;
  (message << ... << parts);
  throw std::runtime_error(message.str());
}

// A new CPU tensor of this shape and dtype. (Through the C shim: torch::stable::new_empty finds aten::new_empty by
// name in the dispatcher at every call, a few microseconds, and a step makes about 250 of these calls.)
Tensor empty_of(const std::vector<int64_t>& shape, int32_t dtype) {
  std::vector<int64_t> strides(shape.size());
  int64_t stride = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= shape[i];
  }
  AtenTensorHandle handle = nullptr;
  check(aoti_torch_empty_strided(static_cast<int64_t>(shape.size()), shape.data(), strides.data(),
                                 dtype, aoti_torch_device_type_cpu(), 0,
                                 &handle) == AOTI_TORCH_SUCCESS,
        "could not allocate an output");
  return Tensor(handle);
}

Tensor empty_floats(const std::vector<int64_t>& shape) {
  return empty_of(shape, aoti_torch_dtype_float32());
}

Tensor dense(const Tensor& t) {
  return t.is_contiguous() ? t : torch::stable::contiguous(t);
}

Tensor as(const Tensor& t, ScalarType type) {
  return dense(t.scalar_type() == type ? t : torch::stable::to(t, type));
}

// x [..., K] times the packed weight's transpose: [..., N] (N = 16 x groups), in x's dtype (computed in float32).
Tensor product(const Tensor& input, const Tensor& packed, bool eight) {
  const int64_t K = input.size(-1), nb = K / 32, bytes = eight ? fuzzyspec::Q8_BYTES : fuzzyspec::Q4_BYTES;
  check(K % 32 == 0 && packed.dim() == 3 && packed.size(1) == nb && packed.size(2) == bytes &&
            packed.is_contiguous() && packed.scalar_type() == ScalarType::Byte,
        "a packed weight [groups, ", nb, ", ", bytes, "] bytes for ", K, " inputs");
  const int64_t G = packed.size(0), N = G * fuzzyspec::ROWS;
  const Tensor x = as(input, ScalarType::Float);
  const int64_t M = K ? x.numel() / K : 0;
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = N;
  Tensor out = empty_floats(shape);
  (eight ? fuzzyspec::product_q8 : fuzzyspec::product_q4)(x.const_data_ptr<float>(), M, K,
                                                          packed.const_data_ptr<uint8_t>(), G,
                                                          out.mutable_data_ptr<float>());
  return input.scalar_type() == ScalarType::Float ? out : torch::stable::to(out, input.scalar_type());
}

Tensor mm_q4(Tensor x, Tensor packed) {
  return product(x, packed, false);
}

Tensor mm_q8(Tensor x, Tensor packed) {
  return product(x, packed, true);
}

// An EAGLE head's input, fc([embedding[tokens] ; features]) + bias, in one call where a draft step made four (the
// lookup, the concatenation, the product, the bias): each operation right after a target pass, which streams three
// times the L3 cache, runs cold, tens of microseconds whatever its size. tokens [..., T] int64, features
// [..., T, H] float32, embedding [V, H] float32, packed: fc's 8-bit bytes for 2H inputs, bias [N] float32 or empty.
// The same numbers as those four operations: rows copied, the same product, then one float add per output.
Tensor head_input(Tensor tokens, Tensor features, Tensor embedding, Tensor packed, Tensor bias) {
  check(tokens.scalar_type() == ScalarType::Long && features.scalar_type() == ScalarType::Float &&
            embedding.scalar_type() == ScalarType::Float && embedding.dim() == 2 && features.dim() == tokens.dim() + 1,
        "head_input: int64 tokens [..., T], float32 features [..., T, H] and embedding [V, H]");
  const int64_t V = embedding.size(0), H = embedding.size(1), T = tokens.numel();
  bool shaped = features.size(-1) == H;
  for (int64_t i = 0; i < tokens.dim(); ++i) shaped = shaped && features.size(i) == tokens.size(i);
  check(shaped, "head_input: features [..., T, ", H, "] for tokens [..., T]");
  const Tensor ids = dense(tokens), table = dense(embedding), given = dense(features);
  const int64_t* id = ids.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) check(id[t] >= 0 && id[t] < V, "head_input: a token id past the ", V, " rows");
  std::vector<int64_t> shape(tokens.sizes().begin(), tokens.sizes().end());
  shape.push_back(2 * H);
  Tensor x = empty_floats(shape);
  float* row = x.mutable_data_ptr<float>();
  const float *rows = table.const_data_ptr<float>(), *feature = given.const_data_ptr<float>();
  for (int64_t t = 0; t < T; ++t, row += 2 * H) {
    std::memcpy(row, rows + id[t] * H, H * sizeof(float));
    std::memcpy(row + H, feature + t * H, H * sizeof(float));
  }
  Tensor out = product(x, packed, true);
  const int64_t N = out.size(-1);
  if (bias.numel()) {
    check(bias.scalar_type() == ScalarType::Float && bias.dim() == 1 && bias.numel() == N,
          "head_input: a float32 bias of ", N);
    const Tensor b = dense(bias);
    const float* add = b.const_data_ptr<float>();
    float* y = out.mutable_data_ptr<float>();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = 0; n < N; ++n) y[t * N + n] += add[n];
  }
  return out;
}

// logits [M, N] (a product over 4-bit rows, rewritten in place), x [M, K] its inputs, weight [V, K] the float rows,
// ids [N] the weight row of each logit (RoundedRows in vocab.py).
void top_again(Tensor logits, Tensor x, Tensor weight, Tensor ids, int64_t k) {
  check(logits.dim() == 2 && x.dim() == 2 && weight.dim() == 2 && ids.dim() == 1 && logits.size(0) == x.size(0) &&
            weight.size(1) == x.size(1) && ids.size(0) == logits.size(1),
        "logits [M, N], x [M, K], weight [V, K] and ids [N]");
  check(logits.scalar_type() == ScalarType::Float && x.scalar_type() == ScalarType::Float &&
            weight.scalar_type() == ScalarType::Float && ids.scalar_type() == ScalarType::Long,
        "float32 values, int64 ids");
  check(logits.is_contiguous() && x.is_contiguous() && weight.is_contiguous() && ids.is_contiguous(),
        "contiguous tensors");
  fuzzyspec::top_again(logits.mutable_data_ptr<float>(), logits.size(0), logits.size(1), x.const_data_ptr<float>(),
                       x.size(1), weight.const_data_ptr<float>(), ids.const_data_ptr<int64_t>(), k);
}

Tensor attend(Tensor query, Tensor keys, Tensor values, Tensor mask, double scale) {
  check(query.dim() == 4 && keys.dim() == 4 && values.sizes().equals(keys.sizes()) && mask.dim() == 4,
        "attend: query [B, W, H, D], keys and values [B, KVH, C, D], mask [B, 1, W, C]");
  check(query.scalar_type() == ScalarType::Float && mask.scalar_type() == ScalarType::Bool &&
            (keys.scalar_type() == ScalarType::Float || keys.scalar_type() == ScalarType::Half) &&
            values.scalar_type() == keys.scalar_type(),
        "attend: a float32 query, float32 or float16 keys and values, and a bool mask");
  const Tensor q = dense(query), k = dense(keys), v = dense(values), allowed = dense(mask);
  const int64_t B = q.size(0), W = q.size(1), H = q.size(2), D = q.size(3), KVH = k.size(1), C = k.size(2);
  check(k.size(0) >= B && k.size(3) == D && H % KVH == 0 && allowed.size(0) == B && allowed.size(2) == W &&
            allowed.size(3) == C,
        "attend: shapes disagree");
  Tensor out = empty_floats({B, W, H, D});
  fuzzyspec::attend(q.const_data_ptr<float>(), k.const_data_ptr(), v.const_data_ptr(),
                    k.scalar_type() == ScalarType::Half, allowed.const_data_ptr<bool>(), static_cast<float>(scale), B,
                    W, H, D, KVH, C, out.mutable_data_ptr<float>());
  return out;
}

// y = w * (x / sqrt(mean(x^2) + eps)) along the last dimension of x (float32).
Tensor rms_norm(Tensor x, Tensor weight, double eps) {
  check(x.scalar_type() == ScalarType::Float && weight.scalar_type() == ScalarType::Float,
        "rms_norm: float32 tensors");
  const Tensor input = dense(x), w = dense(weight);
  const int64_t size = input.size(-1), rows = size ? input.numel() / size : 0;
  check(w.numel() == size, "rms_norm: one weight per feature");
  Tensor out = empty_floats(std::vector<int64_t>(input.sizes().begin(), input.sizes().end()));
  fuzzyspec::rms_norm(input.const_data_ptr<float>(), w.const_data_ptr<float>(), rows, size, static_cast<float>(eps),
                      out.mutable_data_ptr<float>());
  return out;
}

// The checks a layer's cache writes need, before anything is written: where [B, 1] and write [B, T] (int64) name
// a slot and a position within keys [slots, kv_heads, capacity, D] for each token. Returns them as int64.
std::pair<Tensor, Tensor> slots_and_positions(const Tensor& where, const Tensor& write, const Tensor& keys,
                                              int64_t rows, int64_t width, const char* op) {
  const Tensor slot = as(where, ScalarType::Long), position = as(write, ScalarType::Long);
  check(slot.numel() == rows && position.numel() == rows * width, op, ": where [B, 1], write [B, T]");
  const int64_t *slots = slot.const_data_ptr<int64_t>(), *positions = position.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < rows; ++b) {
    check(slots[b] >= 0 && slots[b] < keys.size(0), op, ": a row past the cache's slots");
    for (int64_t t = 0; t < width; ++t)
      check(positions[b * width + t] >= 0 && positions[b * width + t] < keys.size(2), op,
            ": a position past the cache's end");
  }
  return {slot, position};
}

// The kernels' view of a layer's cache tensors (checked already).
fuzzyspec::Cache cache_of(Tensor& keys, Tensor& values) {
  return {keys.mutable_data_ptr(), values.mutable_data_ptr(), keys.scalar_type() == ScalarType::Half,
          {keys.stride(0), keys.stride(1), keys.stride(2), keys.stride(3)},
          {values.stride(0), values.stride(1), values.stride(2), values.stride(3)}};
}

// t [B, T, F] read where it lies where its features are contiguous and its tokens evenly spaced (q, k and v, views of
// one fused projection's output, are); else a dense copy. Returns the tensor and its tokens' spacing.
std::pair<Tensor, int64_t> tokens_of(const Tensor& t) {
  if (t.stride(2) == 1) {
    const int64_t B = t.size(0), T = t.size(1), step = T > 1 ? t.stride(1) : t.stride(0);
    if (B == 1 || T == 1 || t.stride(0) == T * t.stride(1)) return {t, step};
  }
  const Tensor copy = dense(t);
  return {copy, copy.size(-1)};
}

// A layer's rotary embedding and cache writes: q, k, v [B, T, heads * D], cos and sin [B, T, 1, D]; k rotated and v
// go into keys and values [slots, kv_heads, capacity, D] at row where[b, 0] and position write[b, t]; returns q
// rotated, [B, T, heads, D].
Tensor rope_store(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor keys, Tensor values, Tensor where,
                  Tensor write, int64_t heads, int64_t kv_heads) {
  for (const Tensor* t : {&q, &k, &v, &cos, &sin})
    check(t->scalar_type() == ScalarType::Float, "rope_store: float32 q, k, v, cos and sin");
  check((keys.scalar_type() == ScalarType::Float || keys.scalar_type() == ScalarType::Half) &&
            values.scalar_type() == keys.scalar_type(),
        "rope_store: a float32 or float16 cache");
  check(keys.dim() == 4 && values.sizes().equals(keys.sizes()), "rope_store: keys and values [slots, kv, capacity, D]");
  check(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "rope_store: q, k and v [B, T, features]");
  const int64_t rows = q.size(0), width = q.size(1), dim = keys.size(3);
  check(k.size(0) == rows && v.size(0) == rows && k.size(1) == width && v.size(1) == width,
        "rope_store: q, k and v for the same tokens");
  check(q.size(-1) == heads * dim && k.size(-1) == kv_heads * dim && v.size(-1) == kv_heads * dim &&
            keys.size(1) == kv_heads,
        "rope_store: head counts and sizes disagree");
  const auto [qc, q_step] = tokens_of(q);
  const auto [kc, k_step] = tokens_of(k);
  const auto [vc, v_step] = tokens_of(v);
  const int64_t steps[3] = {q_step, k_step, v_step};
  const Tensor cc = dense(cos), sc = dense(sin);
  check(cc.numel() == rows * width * dim && sc.numel() == cc.numel(), "rope_store: cos and sin [B, T, 1, D]");
  const auto [slot, position] = slots_and_positions(where, write, keys, rows, width, "rope_store");
  const int64_t *slots = slot.const_data_ptr<int64_t>(), *positions = position.const_data_ptr<int64_t>();
  Tensor out = empty_floats({rows, width, heads, dim});
  const fuzzyspec::Cache cache = cache_of(keys, values);
  fuzzyspec::rope_store(qc.const_data_ptr<float>(), kc.const_data_ptr<float>(), vc.const_data_ptr<float>(), steps,
                        cc.const_data_ptr<float>(), sc.const_data_ptr<float>(), cache, slots, positions, rows, width,
                        heads, kv_heads, dim, out.mutable_data_ptr<float>());
  return out;
}

// silu(gate) * up of a fused gate|up product's output [..., 2 * inner] (its halves): [..., inner].
Tensor silu_mul(Tensor gate_up) {
  check(gate_up.scalar_type() == ScalarType::Float && gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
        "silu_mul: a float32 gate|up output of even width");
  const Tensor input = dense(gate_up);
  const int64_t inner = gate_up.size(-1) / 2, rows = inner ? gate_up.numel() / (2 * inner) : 0;
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = inner;
  Tensor out = empty_floats(shape);
  fuzzyspec::silu_mul(input.const_data_ptr<float>(), rows, inner, 2 * inner, out.mutable_data_ptr<float>());
  return out;
}

// A packed weight for product_q4 (``eight``: product_q8) with ``inputs`` inputs and at least ``outputs`` outputs:
// its groups.
int64_t groups_of(const Tensor& packed, bool eight, int64_t inputs, int64_t outputs, const char* name) {
  const int64_t bytes = eight ? fuzzyspec::Q8_BYTES : fuzzyspec::Q4_BYTES;
  check(packed.dim() == 3 && packed.size(1) * 32 == inputs && packed.size(2) == bytes &&
            packed.size(0) * fuzzyspec::ROWS >= outputs && packed.is_contiguous() &&
            packed.scalar_type() == ScalarType::Byte,
        "decoder_layer: ", name, " packed as [groups, ", inputs / 32, ", ", bytes, "] bytes for ", inputs,
        " inputs and ", outputs, " outputs");
  return packed.size(0);
}

// One decoder layer's weights as layer_kernel.cpp takes them, checked: an empty input_norm is none (an EAGLE head's
// layer); the projections' format is the q|k|v weight's (all four alike).
fuzzyspec::Layer layer_of(const Tensor& input_norm, double input_eps, const Tensor& qkv, const Tensor& o,
                          const Tensor& post_norm, double post_eps, const Tensor& gate_up, const Tensor& down,
                          int64_t hidden, int64_t heads, int64_t kv_heads, int64_t dim, double scale) {
  const int64_t inner = down.dim() == 3 ? down.size(1) * 32 : 0;
  const bool normed = input_norm.numel() > 0;
  for (const Tensor* norm : {&input_norm, &post_norm})
    check(norm->scalar_type() == ScalarType::Float && norm->is_contiguous() &&
              (norm->numel() == hidden || (norm == &input_norm && !normed)),
          "decoder_layer: float32 norm weights, one per feature");
  check(kv_heads > 0 && heads % kv_heads == 0, "decoder_layer: heads in whole groups per kv head");
  const bool eight = qkv.dim() == 3 && qkv.size(2) == fuzzyspec::Q8_BYTES;
  const int64_t qkv_groups = groups_of(qkv, eight, hidden, (heads + 2 * kv_heads) * dim, "q|k|v"),
                o_groups = groups_of(o, eight, heads * dim, hidden, "o"),
                gate_up_groups = groups_of(gate_up, eight, hidden, 2 * inner, "gate|up"),
                down_groups = groups_of(down, eight, inner, hidden, "down");
  return {normed ? input_norm.const_data_ptr<float>() : nullptr, post_norm.const_data_ptr<float>(),
          static_cast<float>(input_eps), static_cast<float>(post_eps), eight, qkv.const_data_ptr<uint8_t>(),
          o.const_data_ptr<uint8_t>(), gate_up.const_data_ptr<uint8_t>(), down.const_data_ptr<uint8_t>(), qkv_groups,
          o_groups, gate_up_groups, down_groups, hidden, inner, heads, kv_heads, dim, static_cast<float>(scale)};
}

// Decoder layers of 4-bit or 8-bit projections, one after another, each whole (layer_kernel.cpp): h [B, T, hidden] ->
// [B, T, hidden]. Layer i's weights are item i of each list, its cache keys[i] and values[i] (contiguous float32 or
// float16 [slots, kv_heads, capacity, D], written as rope_store writes), and every layer takes the same positions,
// cos and sin, and mask [B, 1, T, capacity] (as attend does). Everything is checked before anything is written.
// A model's layers in one call, where a call a layer cost about 20 us each of Python and the dispatcher.
struct Stack {  // the layers' lists and shape, as decoder_layers takes them, checked (``stack_of``)
  std::vector<fuzzyspec::Layer> layers;
  int64_t hidden, dim, capacity;
};

Stack stack_of(int64_t hidden, const std::vector<Tensor>& input_norms, const std::vector<double>& input_eps,
               const std::vector<Tensor>& qkv, const std::vector<Tensor>& o, const std::vector<Tensor>& post_norms,
               const std::vector<double>& post_eps, const std::vector<Tensor>& gate_up,
               const std::vector<Tensor>& down, const std::vector<Tensor>& keys, const std::vector<Tensor>& values,
               int64_t heads, int64_t kv_heads, double scale, const Tensor& final_norm) {
  const size_t count = qkv.size();
  check(count > 0 && input_norms.size() == count && input_eps.size() == count && o.size() == count &&
            post_norms.size() == count && post_eps.size() == count && gate_up.size() == count &&
            down.size() == count && keys.size() == count && values.size() == count,
        "decoder_layers: one item a layer in every list");
  for (size_t i = 0; i < count; ++i)
    check((keys[i].scalar_type() == ScalarType::Float || keys[i].scalar_type() == ScalarType::Half) &&
              values[i].scalar_type() == keys[i].scalar_type() && keys[i].dim() == 4 &&
              values[i].sizes().equals(keys[i].sizes()) && keys[i].sizes().equals(keys[0].sizes()) &&
              keys[i].is_contiguous() && values[i].is_contiguous() && keys[i].size(1) == kv_heads,
          "decoder_layer: contiguous float32 or float16 keys and values [slots, kv_heads, capacity, D]");
  check(final_norm.numel() == 0 || (final_norm.scalar_type() == ScalarType::Float && final_norm.numel() == hidden),
        "decoder_layers: a float32 final norm of ", hidden, " weights, or none");
  Stack stack{{}, hidden, keys[0].size(3), keys[0].size(2)};
  for (size_t i = 0; i < count; ++i)
    stack.layers.push_back(layer_of(input_norms[i], input_eps[i], qkv[i], o[i], post_norms[i], post_eps[i],
                                    gate_up[i], down[i], hidden, heads, kv_heads, stack.dim, scale));
  return stack;
}

// The layers over x [rows, width, hidden] (float32, contiguous), cos and sin [rows, width, D] each, then the final
// norm where one is given: the output, in a new tensor.
Tensor run_stack(const Stack& stack, const float* x, int64_t rows, int64_t width, const float* cos, const float* sin,
                 std::vector<Tensor>& keys, std::vector<Tensor>& values, const Tensor& where, const Tensor& write,
                 const Tensor& mask, const Tensor& final_norm, double final_eps) {
  const size_t count = stack.layers.size();
  const int64_t hidden = stack.hidden;
  const Tensor allowed = dense(mask);
  check(allowed.scalar_type() == ScalarType::Bool && allowed.dim() == 4 && allowed.size(0) == rows &&
            allowed.size(2) == width && allowed.size(3) == stack.capacity,
        "decoder_layer: a bool mask [B, 1, T, capacity]");
  const auto [slot, position] = slots_and_positions(where, write, keys[0], rows, width, "decoder_layer");
  // (a layer reads its input whole before its output is written, so two buffers take turns)
  Tensor out[2] = {empty_floats({rows, width, hidden}), empty_floats({count > 1 ? rows : 0, width, hidden})};
  const float* in = x;
  for (size_t i = 0; i < count; ++i) {
    float* result = out[i % 2].mutable_data_ptr<float>();
    fuzzyspec::decoder_layer(in, stack.layers[i], cos, sin, cache_of(keys[i], values[i]), stack.capacity,
                             allowed.const_data_ptr<bool>(), slot.const_data_ptr<int64_t>(),
                             position.const_data_ptr<int64_t>(), rows, width, result);
    in = result;
  }
  if (final_norm.numel() == 0) return out[(count - 1) % 2];
  // The model's final norm, as its own call computes it (rms_norm above), where that call ran cold after the layers'
  // stream of weights: 107-110 us of a 5.4 ms 4-bit step on a 2-core AVX2 EPYC.
  const Tensor weight = dense(final_norm);
  Tensor normed = empty_floats({rows, width, hidden});
  fuzzyspec::rms_norm(in, weight.const_data_ptr<float>(), rows * width, hidden, static_cast<float>(final_eps),
                      normed.mutable_data_ptr<float>());
  return normed;
}

Tensor decoder_layers(Tensor h, std::vector<Tensor> input_norms, std::vector<double> input_eps, std::vector<Tensor> qkv,
                      std::vector<Tensor> o, std::vector<Tensor> post_norms, std::vector<double> post_eps,
                      std::vector<Tensor> gate_up, std::vector<Tensor> down, Tensor cos, Tensor sin,
                      std::vector<Tensor> keys, std::vector<Tensor> values, Tensor where, Tensor write, Tensor mask,
                      int64_t heads, int64_t kv_heads, double scale, Tensor final_norm, double final_eps) {
  check(h.dim() == 3 && h.scalar_type() == ScalarType::Float, "decoder_layer: h [B, T, hidden] float32");
  const int64_t rows = h.size(0), width = h.size(1);
  const Stack stack = stack_of(h.size(2), input_norms, input_eps, qkv, o, post_norms, post_eps, gate_up, down, keys,
                               values, heads, kv_heads, scale, final_norm);
  const Tensor x = dense(h), c = dense(cos), s = dense(sin);
  check(c.scalar_type() == ScalarType::Float && s.scalar_type() == ScalarType::Float &&
            c.numel() == rows * width * stack.dim && s.numel() == c.numel(),
        "decoder_layer: float32 cos and sin [B, T, 1, D]");
  return run_stack(stack, x.const_data_ptr<float>(), rows, width, c.const_data_ptr<float>(),
                   s.const_data_ptr<float>(), keys, values, where, write, mask, final_norm, final_eps);
}

// ``decoder_layers`` from the tokens [B, T] (int64): their rows of ``embedding`` [V, hidden] (float32) as the input,
// and each token's cos and sin read from ``angles`` [2, P, D] (float32: every position's, as llama.Rotary keeps them)
// at its position in ``positions`` [B, T]. The lookup and the angles' reads were operations of their own, each cold
// after the previous pass: about 0.17 ms of a 5.3 ms 4-bit step on a 2-core AVX2 EPYC. The same numbers: rows
// copied as they are.
Tensor embedded_layers(Tensor tokens, Tensor embedding, Tensor angles, Tensor positions,
                       std::vector<Tensor> input_norms, std::vector<double> input_eps, std::vector<Tensor> qkv,
                       std::vector<Tensor> o, std::vector<Tensor> post_norms, std::vector<double> post_eps,
                       std::vector<Tensor> gate_up, std::vector<Tensor> down, std::vector<Tensor> keys,
                       std::vector<Tensor> values, Tensor where, Tensor write, Tensor mask, int64_t heads,
                       int64_t kv_heads, double scale, Tensor final_norm, double final_eps) {
  check(tokens.dim() == 2 && positions.dim() == 2 && positions.size(0) == tokens.size(0) &&
            positions.size(1) == tokens.size(1),
        "embedded_layers: integer tokens and positions [B, T]");
  check(embedding.dim() == 2 && embedding.scalar_type() == ScalarType::Float,
        "embedded_layers: a float32 embedding [V, hidden]");
  const int64_t rows = tokens.size(0), width = tokens.size(1), V = embedding.size(0), hidden = embedding.size(1);
  const Stack stack = stack_of(hidden, input_norms, input_eps, qkv, o, post_norms, post_eps, gate_up, down, keys,
                               values, heads, kv_heads, scale, final_norm);
  const int64_t D = stack.dim;
  check(angles.dim() == 3 && angles.size(0) == 2 && angles.size(2) == D && angles.scalar_type() == ScalarType::Float,
        "embedded_layers: float32 angles [2, positions, ", D, "]");
  const Tensor ids = as(tokens, ScalarType::Long), at = as(positions, ScalarType::Long);
  const Tensor table = dense(embedding), both = dense(angles);
  const int64_t *id = ids.const_data_ptr<int64_t>(), *position = at.const_data_ptr<int64_t>(), P = both.size(1);
  for (int64_t t = 0; t < rows * width; ++t) {
    check(id[t] >= 0 && id[t] < V, "embedded_layers: a token id past the ", V, " rows");
    check(position[t] >= 0 && position[t] < P, "embedded_layers: a position past the ", P, " angles kept");
  }
  Tensor x = empty_floats({rows, width, hidden});
  Tensor cos = empty_floats({rows, width, D}), sin = empty_floats({rows, width, D});
  float *row = x.mutable_data_ptr<float>(), *c = cos.mutable_data_ptr<float>(), *s = sin.mutable_data_ptr<float>();
  const float *rows_of = table.const_data_ptr<float>(), *cos_of = both.const_data_ptr<float>();
  const float* sin_of = cos_of + P * D;
  for (int64_t t = 0; t < rows * width; ++t) {
    std::memcpy(row + t * hidden, rows_of + id[t] * hidden, hidden * sizeof(float));
    std::memcpy(c + t * D, cos_of + position[t] * D, D * sizeof(float));
    std::memcpy(s + t * D, sin_of + position[t] * D, D * sizeof(float));
  }
  return run_stack(stack, row, rows, width, c, s, keys, values, where, write, mask, final_norm, final_eps);
}

// One decoder layer (``decoder_layers`` of one): an EAGLE head's, or a model's where each layer is called alone.
Tensor decoder_layer(Tensor h, Tensor input_norm, double input_eps, Tensor qkv, Tensor o, Tensor post_norm,
                     double post_eps, Tensor gate_up, Tensor down, Tensor cos, Tensor sin, Tensor keys, Tensor values,
                     Tensor where, Tensor write, Tensor mask, int64_t heads, int64_t kv_heads, double scale) {
  return decoder_layers(h, {input_norm}, {input_eps}, {qkv}, {o}, {post_norm}, {post_eps}, {gate_up}, {down}, cos,
                        sin, {keys}, {values}, where, write, mask, heads, kv_heads, scale, empty_floats({0}), 0.0);
}

// kvcache.attention_mask in one call where PyTorch made seven, each cold after a target pass: [B, 1, k, capacity]
// bool, query i of row b seeing the row's cached positions (< starts[b]) and the new positions starts[b] + j that
// tree [B, k, k] allows.
Tensor attention_mask(Tensor starts, Tensor tree, int64_t capacity) {
  check(starts.scalar_type() == ScalarType::Long && starts.dim() == 1 && tree.scalar_type() == ScalarType::Bool &&
            tree.dim() == 3 && tree.size(0) == starts.size(0) && tree.size(1) == tree.size(2),
        "attention_mask: int64 starts [B] and a bool tree [B, k, k]");
  const int64_t B = tree.size(0), k = tree.size(1);
  const Tensor first = dense(starts), allowed = dense(tree);
  const int64_t* start = first.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    check(k <= capacity && start[b] >= 0 && start[b] <= capacity - k, "attention_mask: ", k, " positions from ",
          start[b], " past a cache of ", capacity);
  Tensor mask = empty_of({B, 1, k, capacity}, aoti_torch_dtype_bool());
  bool* row = static_cast<bool*>(mask.mutable_data_ptr());
  const bool* sees = static_cast<const bool*>(allowed.const_data_ptr());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < k; ++i, row += capacity) {
      std::fill(row, row + start[b], true);
      std::copy(sees + (b * k + i) * k, sees + (b * k + i + 1) * k, row + start[b]);
      std::fill(row + start[b] + k, row + capacity, false);
    }
  return mask;
}

// A tree's kept path moved down in one slot of every layer's cache, in one call: in each of ``caches`` ([slots,
// kv_heads, capacity, D] of any dtype, D contiguous), position start + columns[i] goes to start + i.
void keep_columns(std::vector<Tensor> caches, int64_t slot, int64_t start, std::vector<int64_t> columns) {
  const int64_t count = static_cast<int64_t>(columns.size());
  for (int64_t i = 0; i < count; ++i)
    check(columns[i] >= i && (i == 0 || columns[i] > columns[i - 1]),
          "keep_columns: columns ascending, each at or past its place");
  for (const Tensor& t : caches) {  // (all checked before anything moves)
    check(t.is_cpu() && t.dim() == 4 && t.stride(3) == 1,
          "keep_columns: CPU caches [slots, kv_heads, capacity, D], D contiguous");
    check(slot >= 0 && slot < t.size(0) && start >= 0 && (count == 0 || start + columns[count - 1] < t.size(2)),
          "keep_columns: a position past the cache");
  }
  for (const Tensor& t : caches) {
    const int64_t size = static_cast<int64_t>(t.element_size());
    fuzzyspec::keep_columns(static_cast<char*>(t.mutable_data_ptr()) + slot * t.stride(0) * size, t.size(1),
                            t.stride(1) * size, t.stride(2) * size, t.size(3) * size, start, columns.data(), count);
  }
}

}  // namespace

STABLE_TORCH_LIBRARY(fuzzyspec_int4, m) {
  m.def("mm_q4(Tensor x, Tensor packed) -> Tensor");
  m.def("mm_q8(Tensor x, Tensor packed) -> Tensor");
  m.def("head_input(Tensor tokens, Tensor features, Tensor embedding, Tensor packed, Tensor bias) -> Tensor");
  m.def("top_again(Tensor(a!) logits, Tensor x, Tensor weight, Tensor ids, int k) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(fuzzyspec_int4, CPU, m) {
  m.impl("mm_q4", TORCH_BOX(&mm_q4));
  m.impl("mm_q8", TORCH_BOX(&mm_q8));
  m.impl("head_input", TORCH_BOX(&head_input));
  m.impl("top_again", TORCH_BOX(&top_again));
}

STABLE_TORCH_LIBRARY(fuzzyspec_attention, m) {
  m.def("attend(Tensor query, Tensor keys, Tensor values, Tensor mask, float scale) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(fuzzyspec_attention, CPU, m) { m.impl("attend", TORCH_BOX(&attend)); }

STABLE_TORCH_LIBRARY(fuzzyspec_layer, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope_store(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) keys, Tensor(b!) values, "
        "Tensor where, Tensor write, int heads, int kv_heads) -> Tensor");
  m.def("keep_columns(Tensor(a!)[] caches, int slot, int start, int[] columns) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("attention_mask(Tensor starts, Tensor tree, int capacity) -> Tensor");
  m.def("decoder_layer(Tensor h, Tensor input_norm, float input_eps, Tensor qkv, Tensor o, Tensor post_norm, "
        "float post_eps, Tensor gate_up, Tensor down, Tensor cos, Tensor sin, Tensor(a!) keys, Tensor(b!) values, "
        "Tensor where, Tensor write, Tensor mask, int heads, int kv_heads, float scale) -> Tensor");
  m.def("decoder_layers(Tensor h, Tensor[] input_norms, float[] input_eps, Tensor[] qkv, Tensor[] o, "
        "Tensor[] post_norms, float[] post_eps, Tensor[] gate_up, Tensor[] down, Tensor cos, Tensor sin, "
        "Tensor(a!)[] keys, Tensor(b!)[] values, Tensor where, Tensor write, Tensor mask, int heads, int kv_heads, "
        "float scale, Tensor final_norm, float final_eps) -> Tensor");
  m.def("embedded_layers(Tensor tokens, Tensor embedding, Tensor angles, Tensor positions, Tensor[] input_norms, "
        "float[] input_eps, Tensor[] qkv, Tensor[] o, Tensor[] post_norms, float[] post_eps, Tensor[] gate_up, "
        "Tensor[] down, Tensor(a!)[] keys, Tensor(b!)[] values, Tensor where, Tensor write, Tensor mask, int heads, "
        "int kv_heads, float scale, Tensor final_norm, float final_eps) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(fuzzyspec_layer, CPU, m) {
  m.impl("rms_norm", TORCH_BOX(&rms_norm));
  m.impl("rope_store", TORCH_BOX(&rope_store));
  m.impl("keep_columns", TORCH_BOX(&keep_columns));
  m.impl("silu_mul", TORCH_BOX(&silu_mul));
  m.impl("attention_mask", TORCH_BOX(&attention_mask));
  m.impl("decoder_layer", TORCH_BOX(&decoder_layer));
  m.impl("decoder_layers", TORCH_BOX(&decoder_layers));
  m.impl("embedded_layers", TORCH_BOX(&embedded_layers));
}
