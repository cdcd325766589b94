// The CPU kernels as torch ops: each checks its tensors (one line for a wrong shape, dtype or place, before anything
// is written), makes its output, and calls the kernel over plain arrays (kernels.h; int4_kernel.cpp and
// layer_kernel.cpp say what each computes). torch's headers are parsed here alone: about 4.3 s of a first use's
// build on 2 cores. The headers used, not ATen/ATen.h: it took 7 of the 9 s a first use spent building the kernels.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <vector>

#include "kernels.h"

namespace {

// x [..., K] times the packed weight's transpose: [..., N] (N = 16 x groups), in x's dtype (computed in float32).
at::Tensor product(const at::Tensor& input, const at::Tensor& packed, bool eight) {
  const int64_t K = input.size(-1), nb = K / 32, bytes = eight ? fuzzyspec::Q8_BYTES : fuzzyspec::Q4_BYTES;
  TORCH_CHECK(K % 32 == 0 && packed.dim() == 3 && packed.size(1) == nb && packed.size(2) == bytes &&
              packed.is_contiguous() && packed.scalar_type() == at::kByte,
              "a packed weight [groups, ", nb, ", ", bytes, "] bytes for ", K, " inputs");
  const int64_t G = packed.size(0), N = G * fuzzyspec::ROWS;
  const at::Tensor x = input.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = N;
  at::Tensor out = x.new_empty({M, N});
  (eight ? fuzzyspec::product_q8 : fuzzyspec::product_q4)(x.data_ptr<float>(), M, K, packed.data_ptr<uint8_t>(), G,
                                                          out.data_ptr<float>());
  return out.view(shape).to(input.scalar_type());
}

at::Tensor mm_q4(const at::Tensor& x, const at::Tensor& packed) {
  return product(x, packed, false);
}

at::Tensor mm_q8(const at::Tensor& x, const at::Tensor& packed) {
  return product(x, packed, true);
}

// logits [M, N] (a product over 4-bit rows, rewritten in place), x [M, K] its inputs, weight [V, K] the float rows,
// ids [N] the weight row of each logit (RoundedRows in vocab.py).
void top_again(at::Tensor logits, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& ids, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && x.dim() == 2 && weight.dim() == 2 && ids.dim() == 1 &&
              logits.size(0) == x.size(0) && weight.size(1) == x.size(1) && ids.size(0) == logits.size(1),
              "logits [M, N], x [M, K], weight [V, K] and ids [N]");
  TORCH_CHECK(logits.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat &&
              weight.scalar_type() == at::kFloat && ids.scalar_type() == at::kLong, "float32 values, int64 ids");
  TORCH_CHECK(logits.is_contiguous() && x.is_contiguous() && weight.is_contiguous() && ids.is_contiguous(),
              "contiguous tensors");
  fuzzyspec::top_again(logits.data_ptr<float>(), logits.size(0), logits.size(1), x.data_ptr<float>(), x.size(1),
                       weight.data_ptr<float>(), ids.data_ptr<int64_t>(), k);
}

at::Tensor attend(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& mask,
                  double scale) {
  TORCH_CHECK(query.dim() == 4 && keys.dim() == 4 && values.sizes() == keys.sizes() && mask.dim() == 4,
              "attend: query [B, W, H, D], keys and values [B, KVH, C, D], mask [B, 1, W, C]");
  TORCH_CHECK(query.scalar_type() == at::kFloat && mask.scalar_type() == at::kBool &&
              (keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kHalf) &&
              values.scalar_type() == keys.scalar_type(),
              "attend: a float32 query, float32 or float16 keys and values, and a bool mask");
  const at::Tensor q = query.contiguous(), k = keys.contiguous(), v = values.contiguous(), allowed = mask.contiguous();
  const int64_t B = q.size(0), W = q.size(1), H = q.size(2), D = q.size(3), KVH = k.size(1), C = k.size(2);
  TORCH_CHECK(k.size(0) >= B && k.size(3) == D && H % KVH == 0 && allowed.size(0) == B && allowed.size(2) == W &&
              allowed.size(3) == C, "attend: shapes disagree");
  at::Tensor out = q.new_empty(q.sizes());
  fuzzyspec::attend(q.data_ptr<float>(), k.data_ptr(), v.data_ptr(), k.scalar_type() == at::kHalf,
                    allowed.data_ptr<bool>(), static_cast<float>(scale), B, W, H, D, KVH, C, out.data_ptr<float>());
  return out;
}

// y = w * (x / sqrt(mean(x^2) + eps)) along the last dimension of x (float32).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm: float32 tensors");
  const at::Tensor input = x.contiguous(), w = weight.contiguous();
  const int64_t size = input.size(-1), rows = size ? input.numel() / size : 0;
  TORCH_CHECK(w.numel() == size, "rms_norm: one weight per feature");
  at::Tensor out = input.new_empty(input.sizes());
  fuzzyspec::rms_norm(input.data_ptr<float>(), w.data_ptr<float>(), rows, size, static_cast<float>(eps),
                      out.data_ptr<float>());
  return out;
}

// A layer's rotary embedding and cache writes: q, k, v [B, T, heads * D], cos and sin [B, T, 1, D]; k rotated and v
// go into keys and values [slots, kv_heads, capacity, D] at row where[b, 0] and position write[b, t]; returns q
// rotated, [B, T, heads, D].
at::Tensor rope_store(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                      const at::Tensor& sin, at::Tensor& keys, at::Tensor& values, const at::Tensor& where,
                      const at::Tensor& write, int64_t heads, int64_t kv_heads) {
  for (const at::Tensor* t : {&q, &k, &v, &cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "rope_store: float32 q, k, v, cos and sin");
  TORCH_CHECK((keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kHalf) &&
              values.scalar_type() == keys.scalar_type(), "rope_store: a float32 or float16 cache");
  TORCH_CHECK(keys.dim() == 4 && values.sizes() == keys.sizes(),
              "rope_store: keys and values [slots, kv, capacity, D]");
  const int64_t rows = q.size(0), width = q.size(1), dim = keys.size(3), capacity = keys.size(2);
  TORCH_CHECK(q.size(-1) == heads * dim && k.size(-1) == kv_heads * dim && v.size(-1) == kv_heads * dim &&
                  keys.size(1) == kv_heads, "rope_store: head counts and sizes disagree");
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const at::Tensor cc = cos.contiguous(), sc = sin.contiguous();
  const at::Tensor slot = where.to(at::kLong).contiguous(), position = write.to(at::kLong).contiguous();
  TORCH_CHECK(cc.numel() == rows * width * dim && sc.numel() == cc.numel(), "rope_store: cos and sin [B, T, 1, D]");
  TORCH_CHECK(slot.numel() == rows && position.numel() == rows * width, "rope_store: where [B, 1], write [B, T]");
  const int64_t *slots = slot.data_ptr<int64_t>(), *positions = position.data_ptr<int64_t>();
  for (int64_t b = 0; b < rows; ++b) {  // (checked before anything is written)
    TORCH_CHECK(slots[b] >= 0 && slots[b] < keys.size(0), "rope_store: a row past the cache's slots");
    for (int64_t t = 0; t < width; ++t)
      TORCH_CHECK(positions[b * width + t] >= 0 && positions[b * width + t] < capacity,
                  "rope_store: a position past the cache's end");
  }
  at::Tensor out = qc.new_empty({rows, width, heads, dim});
  fuzzyspec::Cache cache{keys.data_ptr(), values.data_ptr(), keys.scalar_type() == at::kHalf,
                         {keys.stride(0), keys.stride(1), keys.stride(2), keys.stride(3)},
                         {values.stride(0), values.stride(1), values.stride(2), values.stride(3)}};
  fuzzyspec::rope_store(qc.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(), cc.data_ptr<float>(),
                        sc.data_ptr<float>(), cache, slots, positions, rows, width, heads, kv_heads, dim,
                        out.data_ptr<float>());
  return out;
}

// A tree's kept path moved down in one slot of every layer's cache, in one call: in each of ``caches`` ([slots,
// kv_heads, capacity, D] of any dtype, D contiguous), position start + columns[i] goes to start + i.
void keep_columns(at::TensorList caches, int64_t slot, int64_t start, at::IntArrayRef columns) {
  const int64_t count = static_cast<int64_t>(columns.size());
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(columns[i] >= i && (i == 0 || columns[i] > columns[i - 1]),
                "keep_columns: columns ascending, each at or past its place");
  for (const at::Tensor& t : caches) {  // (all checked before anything moves)
    TORCH_CHECK(t.device().is_cpu() && t.dim() == 4 && t.stride(3) == 1,
                "keep_columns: CPU caches [slots, kv_heads, capacity, D], D contiguous");
    TORCH_CHECK(slot >= 0 && slot < t.size(0) && start >= 0 &&
                    (count == 0 || start + columns[count - 1] < t.size(2)),
                "keep_columns: a position past the cache");
  }
  for (const at::Tensor& t : caches) {
    const int64_t size = t.element_size();
    fuzzyspec::keep_columns(static_cast<char*>(t.data_ptr()) + slot * t.stride(0) * size, t.size(1),
                            t.stride(1) * size, t.stride(2) * size, t.size(3) * size, start, columns.data(), count);
  }
}

}  // namespace

TORCH_LIBRARY(fuzzyspec_int4, m) {
  m.def("mm_q4(Tensor x, Tensor packed) -> Tensor");
  m.def("mm_q8(Tensor x, Tensor packed) -> Tensor");
  m.def("top_again(Tensor(a!) logits, Tensor x, Tensor weight, Tensor ids, int k) -> ()");
}

TORCH_LIBRARY_IMPL(fuzzyspec_int4, CPU, m) {
  m.impl("mm_q4", &mm_q4);
  m.impl("mm_q8", &mm_q8);
  m.impl("top_again", &top_again);
}

TORCH_LIBRARY(fuzzyspec_attention, m) {
  m.def("attend(Tensor query, Tensor keys, Tensor values, Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(fuzzyspec_attention, CPU, m) { m.impl("attend", &attend); }

TORCH_LIBRARY(fuzzyspec_layer, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope_store(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) keys, Tensor(b!) values, "
        "Tensor where, Tensor write, int heads, int kv_heads) -> Tensor");
  m.def("keep_columns(Tensor(a!)[] caches, int slot, int start, int[] columns) -> ()");
}

TORCH_LIBRARY_IMPL(fuzzyspec_layer, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_store", &rope_store);
  m.impl("keep_columns", &keep_columns);
}
