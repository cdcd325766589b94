// The small steps of a decoder layer between its products, one call each, for eager float32 steps on the CPU.
// Eager PyTorch runs an RMSNorm as six operations and a layer's rotary embedding, with the split of the fused q|k|v
// product and the cache writes, as about twenty; each costs a few microseconds of dispatch for well under a
// microsecond of arithmetic on a token's 576 numbers, about 1.5 ms of a 10 ms step of the embedded model
// (step.py's ``rms_norm`` and ``decoder_layer`` call these). Compiled steps leave them to inductor, which fuses
// them itself.
//
// Every output row is computed by the same operations whatever else is in the batch, so a token's numbers do not
// depend on the pass it is in (as the int4 and attention kernels'). The rotary embedding does, element by element,
// what PyTorch's x cos + rotate_half(x) sin does (a product, a product, a sum; -ffp-contract=off), so its results
// equal eager PyTorch's bit for bit; the norm's mean is summed in 8 lanes, then the lanes in order.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>
#include <initializer_list>

namespace {

// y = w * (x / sqrt(mean(x^2) + eps)) along the last dimension of x (float32).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm: float32 tensors");
  const at::Tensor input = x.contiguous(), w = weight.contiguous();
  const int64_t size = input.size(-1), rows = size ? input.numel() / size : 0;
  TORCH_CHECK(w.numel() == size, "rms_norm: one weight per feature");
  at::Tensor out = at::empty_like(input);
  const float* src = input.data_ptr<float>();
  const float* scale = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = src + r * size;
    float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= size; i += 8)
      for (int j = 0; j < 8; ++j) lanes[j] += row[i + j] * row[i + j];
    for (; i < size; ++i) lanes[i % 8] += row[i] * row[i];
    float sum = 0;
    for (int j = 0; j < 8; ++j) sum += lanes[j];
    const float inverse = 1.0f / std::sqrt(sum / static_cast<float>(size) + static_cast<float>(eps));
    float* target = dst + r * size;
    for (i = 0; i < size; ++i) target[i] = scale[i] * (row[i] * inverse);
  }
  return out;
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

// A layer's rotary embedding and cache writes: q, k, v [B, T, heads * D] (q's, k's, v's heads side by side, as the
// projections give them), cos and sin [B, T, 1, D]; k rotated and v go into keys and values [slots, kv_heads,
// capacity, D] at row where[b, 0] and position write[b, t]; returns q rotated, [B, T, heads, D].
at::Tensor rope_store(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                      const at::Tensor& sin, at::Tensor& keys, at::Tensor& values, const at::Tensor& where,
                      const at::Tensor& write, int64_t heads, int64_t kv_heads) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &v, &cos, &sin, &keys, &values})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "rope_store: float32 tensors");
  TORCH_CHECK(keys.dim() == 4 && values.sizes() == keys.sizes(), "rope_store: keys and values [slots, kv, capacity, D]");
  const int64_t rows = q.size(0), width = q.size(1), dim = keys.size(3), capacity = keys.size(2);
  TORCH_CHECK(q.size(-1) == heads * dim && k.size(-1) == kv_heads * dim && v.size(-1) == kv_heads * dim &&
                  keys.size(1) == kv_heads, "rope_store: head counts and sizes disagree");
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const at::Tensor cc = cos.contiguous(), sc = sin.contiguous();
  const at::Tensor slot = where.to(at::kLong).contiguous(), position = write.to(at::kLong).contiguous();
  TORCH_CHECK(cc.numel() == rows * width * dim && sc.numel() == cc.numel(), "rope_store: cos and sin [B, T, 1, D]");
  TORCH_CHECK(slot.numel() == rows && position.numel() == rows * width, "rope_store: where [B, 1], write [B, T]");
  at::Tensor out = at::empty({rows, width, heads, dim}, q.options());
  const float *qs = qc.data_ptr<float>(), *ks = kc.data_ptr<float>(), *vs = vc.data_ptr<float>();
  const float *cs = cc.data_ptr<float>(), *ss = sc.data_ptr<float>();
  const int64_t *slots = slot.data_ptr<int64_t>(), *positions = position.data_ptr<int64_t>();
  float *kd = keys.data_ptr<float>(), *vd = values.data_ptr<float>(), *qd = out.data_ptr<float>();
  const auto ks0 = keys.stride(0), ks1 = keys.stride(1), ks2 = keys.stride(2), ks3 = keys.stride(3);
  const auto vs0 = values.stride(0), vs1 = values.stride(1), vs2 = values.stride(2), vs3 = values.stride(3);
  for (int64_t b = 0; b < rows; ++b) {  // (checked before anything is written)
    TORCH_CHECK(slots[b] >= 0 && slots[b] < keys.size(0), "rope_store: a row past the cache's slots");
    for (int64_t t = 0; t < width; ++t)
      TORCH_CHECK(positions[b * width + t] >= 0 && positions[b * width + t] < capacity,
                  "rope_store: a position past the cache's end");
  }
  for (int64_t b = 0; b < rows; ++b) {
    const int64_t s = slots[b];
    for (int64_t t = 0; t < width; ++t) {
      const int64_t token = b * width + t, p = positions[token];
      const float *c = cs + token * dim, *n = ss + token * dim;
      for (int64_t h = 0; h < heads; ++h)
        rotate(qs + (token * heads + h) * dim, c, n, dim, qd + (token * heads + h) * dim, 1);
      for (int64_t h = 0; h < kv_heads; ++h) {
        rotate(ks + (token * kv_heads + h) * dim, c, n, dim, kd + s * ks0 + h * ks1 + p * ks2, ks3);
        const float* from = vs + (token * kv_heads + h) * dim;
        float* to = vd + s * vs0 + h * vs1 + p * vs2;
        for (int64_t j = 0; j < dim; ++j) to[j * vs3] = from[j];
      }
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(fuzzyspec_layer, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope_store(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) keys, Tensor(b!) values, "
        "Tensor where, Tensor write, int heads, int kv_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(fuzzyspec_layer, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_store", &rope_store);
}
