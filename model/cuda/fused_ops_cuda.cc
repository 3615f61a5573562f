// model/cuda/fused_ops_cuda.cc: ATen wrappers of the fused kernels (see model/fused_ops.h).
#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>

#include "model/cuda/fused_kernels.h"
#include "model/fused_ops.h"

namespace vlmgraph::ops {
namespace {

bool IsBf16(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16; }

void Check(cudaError_t e, const char* what) {
  TORCH_CHECK(e == cudaSuccess, what, " launch failed: ", cudaGetErrorString(e));
}

const int64_t* OptionalLongPtr(const at::Tensor& t) {
  if (!t.defined()) return nullptr;
  TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous(),
              "index tensors must be contiguous int64");
  return t.data_ptr<int64_t>();
}

}  // namespace

void SetProgrammaticDependentLaunch(bool enabled) { cuda::SetProgrammaticDependentLaunch(enabled); }

bool FusedKernelsAvailable(const at::Tensor& like) {
  return like.defined() && like.is_cuda() &&
         (like.scalar_type() == at::kFloat || like.scalar_type() == at::kBFloat16);
}

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t h = x.size(-1);
  at::Tensor xc = x.contiguous();
  at::Tensor w = weight.to(x.scalar_type()).contiguous();
  at::Tensor out = at::empty_like(xc);
  c10::cuda::CUDAGuard guard(x.device());
  Check(cuda::LaunchRmsNorm(IsBf16(x), xc.data_ptr(), h, w.data_ptr(), out.data_ptr(), h,
                            xc.numel() / h, h, static_cast<float>(eps),
                            c10::cuda::getCurrentCUDAStream()),
        "rms_norm");
  return out;
}

at::Tensor SiluMul(const at::Tensor& gate_up) {
  at::Tensor in = gate_up.contiguous();
  const int64_t inter = in.size(-1) / 2;
  auto sizes = in.sizes().vec();
  sizes.back() = inter;
  at::Tensor out = at::empty(sizes, in.options());
  c10::cuda::CUDAGuard guard(in.device());
  Check(cuda::LaunchSiluMul(IsBf16(in), in.data_ptr(), out.data_ptr(), in.numel() / (2 * inter),
                            inter, c10::cuda::getCurrentCUDAStream()),
        "silu_mul");
  return out;
}

namespace {

// The kernels' view of a paged cache (Note [Paged KV layout], model/kv_cache.h): keys / values
// (num_pages, n_kv, page_size, D) contiguous in the activations' dtype, page_table (rows,
// pages_per_row) int32 contiguous on their device.
cuda::KvPages PagesOf(const at::Tensor& qkv, const at::Tensor& cache_k, const at::Tensor& cache_v,
                      const at::Tensor& page_table) {
  TORCH_CHECK(cache_k.dim() == 4 && cache_k.is_contiguous() && cache_v.is_contiguous() &&
                  cache_k.sizes() == cache_v.sizes() && cache_k.scalar_type() == qkv.scalar_type(),
              "KV cache must be contiguous (num_pages, n_kv, page_size, D) in the activations' "
              "dtype");
  const int64_t page_size = cache_k.size(2);
  TORCH_CHECK(page_size >= 16 && (page_size & (page_size - 1)) == 0,
              "KV page_size must be a power of two >= 16, got ", page_size);
  TORCH_CHECK(page_table.defined() && page_table.dim() == 2 &&
                  page_table.scalar_type() == at::kInt && page_table.is_contiguous() &&
                  page_table.device() == cache_k.device(),
              "page_table must be contiguous (rows, pages_per_row) int32 on the cache's device");
  cuda::KvPages kv;
  kv.table = page_table.data_ptr<int>();
  kv.pages_per_row = static_cast<int>(page_table.size(1));
  kv.page_shift = 0;
  while ((int64_t(1) << kv.page_shift) < page_size) ++kv.page_shift;
  kv.n_kv = static_cast<int>(cache_k.size(1));
  return kv;
}

}  // namespace

RopeKvOutput RopeKvWrite(const at::Tensor& qkv, const at::Tensor& inv_freq, double scaling,
                         const at::Tensor& positions, const at::Tensor& slots, int64_t n_heads,
                         int64_t n_kv, const at::Tensor& cache_k, const at::Tensor& cache_v,
                         const at::Tensor& page_table, bool want_k) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous(),
              "qkv must be contiguous (B, T, (nh + 2 nkv) D)");
  const int64_t b = qkv.size(0), t = qkv.size(1);
  const int64_t d = qkv.size(2) / (n_heads + 2 * n_kv);
  TORCH_CHECK(inv_freq.scalar_type() == at::kFloat && inv_freq.numel() == d / 2,
              "inv_freq must be (D/2) float32");
  RopeKvOutput out;
  out.q = at::empty({b, t, n_heads, d}, qkv.options());
  if (want_k) out.k = at::empty({b, t, n_kv, d}, qkv.options());
  cuda::KvPages kv;
  if (cache_k.defined()) {
    kv = PagesOf(qkv, cache_k, cache_v, page_table);
    TORCH_CHECK(cache_k.size(1) == n_kv && page_table.size(0) >= (slots.defined() ? 1 : b),
                "RopeKvWrite: cache heads or page-table rows");
  }
  at::Tensor freq = inv_freq.contiguous();
  c10::cuda::CUDAGuard guard(qkv.device());
  Check(cuda::LaunchRopeKvWrite(IsBf16(qkv), qkv.data_ptr(), freq.data_ptr<float>(),
                                static_cast<float>(scaling), OptionalLongPtr(positions),
                                OptionalLongPtr(slots), b, t, n_heads, n_kv, d, out.q.data_ptr(),
                                want_k ? out.k.data_ptr() : nullptr,
                                cache_k.defined() ? cache_k.data_ptr() : nullptr,
                                cache_v.defined() ? cache_v.data_ptr() : nullptr, kv,
                                c10::cuda::getCurrentCUDAStream()),
        "rope_kv_write");
  return out;
}

namespace {

// RopeDecodeAttention with or without its combine: (out, partials); out is undefined without.
std::pair<at::Tensor, at::Tensor> DecodeAttention(
    const at::Tensor& qkv, const at::Tensor& inv_freq, double scaling, const at::Tensor& positions,
    const at::Tensor& cache_k, const at::Tensor& cache_v, const at::Tensor& page_table,
    const at::Tensor& semaphores, int64_t kv_len, int64_t n_heads, bool combine) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "qkv must be contiguous (B, (nh + 2 nkv) D)");
  const cuda::KvPages kv = PagesOf(qkv, cache_k, cache_v, page_table);
  const int64_t b = qkv.size(0), n_kv = cache_k.size(1), d = cache_k.size(3);
  TORCH_CHECK(qkv.size(1) == (n_heads + 2 * n_kv) * d && page_table.size(0) >= b &&
                  kv_len <= kv.max_seq() && positions.numel() == b,
              "decode attention shapes");
  TORCH_CHECK(semaphores.scalar_type() == at::kInt && semaphores.is_contiguous() &&
                  semaphores.numel() >= b * n_kv,
              "semaphores must be contiguous int32 (rows, n_kv)");
  TORCH_CHECK(inv_freq.scalar_type() == at::kFloat && inv_freq.numel() == d / 2,
              "inv_freq must be (D/2) float32");
  at::Tensor out = combine ? at::empty({b, n_heads * d}, qkv.options()) : at::Tensor();
  at::Tensor partials =
      at::empty({cuda::RopeDecodeAttentionPartialFloats(b, n_heads, n_kv, d, kv_len)},
                qkv.options().dtype(at::kFloat));
  at::Tensor freq = inv_freq.contiguous();
  c10::cuda::CUDAGuard guard(qkv.device());
  Check(cuda::LaunchRopeDecodeAttention(
            IsBf16(qkv), qkv.data_ptr(), freq.data_ptr<float>(), static_cast<float>(scaling),
            OptionalLongPtr(positions), cache_k.data_ptr(), cache_v.data_ptr(),
            combine ? out.data_ptr() : nullptr, partials.data_ptr<float>(),
            semaphores.data_ptr<int>(), b, n_heads, n_kv, d, kv, kv_len,
            static_cast<float>(1.0 / std::sqrt(static_cast<double>(d))), combine,
            c10::cuda::getCurrentCUDAStream()),
        "rope_decode_attention");
  return {out, partials};
}

}  // namespace

at::Tensor RopeDecodeAttention(const at::Tensor& qkv, const at::Tensor& inv_freq, double scaling,
                               const at::Tensor& positions, const at::Tensor& cache_k,
                               const at::Tensor& cache_v, const at::Tensor& page_table,
                               const at::Tensor& semaphores, int64_t kv_len, int64_t n_heads) {
  return DecodeAttention(qkv, inv_freq, scaling, positions, cache_k, cache_v, page_table,
                         semaphores, kv_len, n_heads, /*combine=*/true)
      .first;
}

// Up to 2 rows the out projection combines the attention's partial states, which takes the
// attention kernel's counter, fence and combine off the step's critical path; at 4 rows it is
// slower, because every one of the projection's blocks combines all rows. Bench:
// `vlmgraph-decode-ops-bench --batch 1` / `--batch 2` / `--batch 4` (whole decoder, both
// combines); figures in docs/design/decode-kernels.md, "The combine in the out projection (1 and
// 2 rows)".
bool DecodeAttentionCombinesInLinear(int64_t batch) { return batch <= 2; }

DecodeAttentionPartials RopeDecodeAttentionPartials(
    const at::Tensor& qkv, const at::Tensor& inv_freq, double scaling, const at::Tensor& positions,
    const at::Tensor& cache_k, const at::Tensor& cache_v, const at::Tensor& page_table,
    const at::Tensor& semaphores, int64_t kv_len, int64_t n_heads) {
  DecodeAttentionPartials a;
  a.partials = DecodeAttention(qkv, inv_freq, scaling, positions, cache_k, cache_v, page_table,
                               semaphores, kv_len, n_heads, /*combine=*/false)
                   .second;
  a.positions = positions;
  a.kv_len = kv_len;
  a.n_heads = n_heads;
  a.n_kv = cache_k.size(1);
  a.head_dim = cache_k.size(3);
  a.dtype = qkv.scalar_type();
  return a;
}

at::Tensor AttentionCombineLinear(const DecodeAttentionPartials& a, const at::Tensor& weight,
                                  const at::Tensor& residual) {
  const int64_t b = a.positions.numel(), n = weight.size(0);
  TORCH_CHECK(b <= cuda::kMaxCudaCoreGemvRows, "AttentionCombineLinear takes up to ",
              cuda::kMaxCudaCoreGemvRows, " rows, got ", b);
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == a.dtype &&
                  weight.size(1) == a.n_heads * a.head_dim &&
                  (!residual.defined() || (residual.is_contiguous() && residual.numel() == b * n &&
                                           residual.scalar_type() == a.dtype)),
              "AttentionCombineLinear: weight (n, n_heads * head_dim) and residual (B, n), "
              "contiguous, in the attention's dtype");
  cuda::AttnCombineArgs comb;
  comb.partials = a.partials.data_ptr<float>();
  comb.positions = OptionalLongPtr(a.positions);
  comb.kv_len = static_cast<int>(a.kv_len);
  comb.n_kv = static_cast<int>(a.n_kv);
  comb.groups = static_cast<int>(a.n_heads / a.n_kv);
  comb.head_dim = static_cast<int>(a.head_dim);
  at::Tensor y = at::empty({b, n}, weight.options());
  c10::cuda::CUDAGuard guard(weight.device());
  Check(cuda::LaunchGemvAttnCombine(a.dtype == at::kBFloat16, comb, weight.data_ptr(),
                                    residual.defined() ? residual.data_ptr() : nullptr,
                                    y.data_ptr(), b, n, c10::cuda::getCurrentCUDAStream()),
        "attention_combine_linear");
  return y;
}

namespace {

// y = f(x) W^T (+ residual) with the GEMV kernel when it applies (rows <= 8, aligned, same dtype);
// an undefined tensor otherwise, and the caller composes the unfused ops.
at::Tensor TryGemv(cuda::GemvInput input, const at::Tensor& x, const at::Tensor& norm_weight,
                   double eps, const at::Tensor& weight, const at::Tensor& residual) {
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t rows = x.numel() / x.size(-1);
  if (rows > cuda::kMaxGemvRows || !x.is_contiguous() || !weight.is_contiguous() ||
      weight.scalar_type() != x.scalar_type() ||
      (residual.defined() && (!residual.is_contiguous() || residual.numel() != rows * n)) ||
      (norm_weight.defined() &&
       (!norm_weight.is_contiguous() || norm_weight.scalar_type() != x.scalar_type()))) {
    return {};
  }
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = n;
  at::Tensor y = at::empty(out_sizes, x.options());
  c10::cuda::CUDAGuard guard(x.device());
  if (cuda::LaunchGemv(IsBf16(x), input, x.data_ptr(),
                       norm_weight.defined() ? norm_weight.data_ptr() : nullptr,
                       static_cast<float>(eps), weight.data_ptr(),
                       residual.defined() ? residual.data_ptr() : nullptr, y.data_ptr(), rows, n, k,
                       c10::cuda::getCurrentCUDAStream()) == cudaSuccess) {
    return y;
  }
  (void)cudaGetLastError();  // unsupported shape or alignment: the caller falls back
  return {};
}

at::Tensor CublasLinear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& residual,
                        bool add_into_residual) {
  const int64_t k = x.size(-1), n = weight.size(0);
  if (!residual.defined()) return at::linear(x, weight);
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = n;
  if (add_into_residual && residual.is_contiguous()) {
    at::Tensor c = residual.view({-1, n});
    return at::addmm_out(c, c, x.reshape({-1, k}), weight.t()).view(out_sizes);
  }
  return at::addmm(residual.reshape({-1, n}), x.reshape({-1, k}), weight.t()).view(out_sizes);
}

}  // namespace

at::Tensor Linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& residual,
                  bool add_into_residual) {
  at::Tensor y = TryGemv(cuda::GemvInput::kPlain, x, {}, 0.0, weight, residual);
  return y.defined() ? y : CublasLinear(x, weight, residual, add_into_residual);
}

at::Tensor RmsNormLinear(const at::Tensor& x, const at::Tensor& norm_weight, double eps,
                         const at::Tensor& weight) {
  at::Tensor y =
      TryGemv(cuda::GemvInput::kRmsNorm, x, norm_weight.to(x.scalar_type()), eps, weight, {});
  return y.defined() ? y : CublasLinear(RmsNorm(x, norm_weight, eps), weight, {}, false);
}

at::Tensor SiluMulLinear(const at::Tensor& gate_up, const at::Tensor& weight,
                         const at::Tensor& residual, bool add_into_residual) {
  at::Tensor y = TryGemv(cuda::GemvInput::kSiluMul, gate_up, {}, 0.0, weight, residual);
  return y.defined() ? y : CublasLinear(SiluMul(gate_up), weight, residual, add_into_residual);
}

// ---- Training: autograd functions -------------------------------------------------------------
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct RmsNormFunction : torch::autograd::Function<RmsNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            double eps) {
    at::Tensor xc = x.contiguous();
    ctx->save_for_backward({xc, weight});
    ctx->saved_data["eps"] = eps;
    return RmsNorm(xc, weight, eps);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& w = saved[1];
    const float eps = static_cast<float>(ctx->saved_data["eps"].toDouble());
    const at::Tensor g = grads[0].contiguous();
    const int64_t h = x.size(-1), rows = x.numel() / h;
    at::Tensor dx = at::empty_like(x);
    at::Tensor partial = at::empty({std::max<int64_t>(1, cuda::RmsNormBackwardBlocks(rows, h)), h},
                                   x.options().dtype(at::kFloat));
    c10::cuda::CUDAGuard guard(x.device());
    Check(cuda::LaunchRmsNormBackward(IsBf16(x), x.data_ptr(), w.data_ptr(), g.data_ptr(),
                                      dx.data_ptr(), partial.data_ptr<float>(), rows, h, eps,
                                      c10::cuda::getCurrentCUDAStream()),
          "rms_norm backward");
    at::Tensor dw = rows == 0 ? at::zeros_like(w) : partial.sum(0, false, w.scalar_type());
    return {dx, dw, at::Tensor()};
  }
};

// q (B, T, n_q, D) and k (B, T, n_k, D), contiguous, through LaunchRotary.
std::pair<at::Tensor, at::Tensor> RunRotary(bool backward, const at::Tensor& q, const at::Tensor& k,
                                            const at::Tensor& cos, const at::Tensor& sin) {
  at::Tensor qo = at::empty_like(q), ko = at::empty_like(k);
  const int64_t tokens = q.size(0) * q.size(1);
  c10::cuda::CUDAGuard guard(q.device());
  Check(cuda::LaunchRotary(IsBf16(q), backward, q.data_ptr(), k.data_ptr(), cos.data_ptr<float>(),
                           sin.data_ptr<float>(), qo.data_ptr(), ko.data_ptr(), tokens, q.size(2),
                           k.size(2), q.size(3), c10::cuda::getCurrentCUDAStream()),
        "rotary");
  return {qo, ko};
}

struct RotaryFunction : torch::autograd::Function<RotaryFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& cos, const at::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["n_q"] = q.size(2);
    ctx->saved_data["n_k"] = k.size(2);
    auto [qo, ko] = RunRotary(false, q.contiguous(), k.contiguous(), cos, sin);
    return {qo, ko};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor gq = grads[0], gk = grads[1];
    if (!gq.defined() && !gk.defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), {}};
    // An output without a gradient (not used by the loss) contributes zero.
    const at::Tensor& like = gq.defined() ? gq : gk;
    const int64_t b = saved[0].size(0), t = saved[0].size(1), d = saved[0].size(2);
    if (!gq.defined()) gq = at::zeros({b, t, ctx->saved_data["n_q"].toInt(), d}, like.options());
    if (!gk.defined()) gk = at::zeros({b, t, ctx->saved_data["n_k"].toInt(), d}, like.options());
    auto [dq, dk] = RunRotary(true, gq.contiguous(), gk.contiguous(), saved[0], saved[1]);
    return {dq, dk, at::Tensor(), at::Tensor()};
  }
};

struct BiasAddFunction : torch::autograd::Function<BiasAddFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& bias) {
    ctx->saved_data["bias_size"] = bias.numel();
    at::Tensor xc = x.contiguous();
    at::Tensor out = at::empty_like(xc);
    const int64_t n = bias.numel();
    c10::cuda::CUDAGuard guard(x.device());
    Check(cuda::LaunchBiasAdd(IsBf16(x), xc.data_ptr(), bias.data_ptr(), out.data_ptr(),
                              n == 0 ? 0 : xc.numel() / n, n, c10::cuda::getCurrentCUDAStream()),
          "bias add");
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // As autograd takes `x + bias`: the gradient passes to x; the bias's is summed over the
    // broadcast dimensions by at::sum_to (the engine's own reduction).
    const at::Tensor& g = grads[0];
    at::Tensor db;
    const int64_t bias_size = ctx->saved_data["bias_size"].toInt();
    if (ctx->needs_input_grad(1)) db = at::sum_to(g, at::IntArrayRef(&bias_size, 1));
    return {g, db};
  }
};

// Note [Logits buffer]: nanoVLM's vocabulary (49218) is not a multiple of 8, and cuBLAS takes
// 2-element-aligned SM80 kernels for GEMMs over it (0.76-0.78 ms each for the head's three
// products at 460M, batch 8 x 256). The forward therefore pads the vocabulary to ld (a multiple of
// 64) with zero weight rows: the logits are a (rows, ld) buffer whose columns [vocab, ld) are 0 and
// never enter the softmax. The backward overwrites the buffer with the logits' gradient (0 in the
// padding columns), so every GEMM runs on aligned, padded shapes; it runs once.
struct LinearCrossEntropyFunction : torch::autograd::Function<LinearCrossEntropyFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden,
                            const at::Tensor& weight, const at::Tensor& targets,
                            int64_t ignore_index) {
    const int64_t rows = hidden.size(0), vocab = weight.size(0), ld = (vocab + 63) / 64 * 64;
    c10::cuda::CUDAGuard guard(hidden.device());
    at::Tensor padded_weight = at::empty({ld, weight.size(1)}, weight.options());
    padded_weight.narrow(0, 0, vocab).copy_(weight);
    padded_weight.narrow(0, vocab, ld - vocab).zero_();
    at::Tensor buffer = at::mm(hidden, padded_weight.t());  // (rows, ld)
    auto f32 = hidden.options().dtype(at::kFloat);
    at::Tensor lse = at::empty({rows}, f32), loss = at::empty({rows}, f32);
    at::Tensor t = targets.contiguous();
    Check(cuda::LaunchCrossEntropy(IsBf16(hidden), false, buffer.data_ptr(), ld, rows, vocab,
                                   t.data_ptr<int64_t>(), ignore_index, lse.data_ptr<float>(),
                                   loss.data_ptr<float>(), nullptr,
                                   c10::cuda::getCurrentCUDAStream()),
          "cross entropy");
    ctx->save_for_backward({hidden, t, lse});
    ctx->saved_data["logits"] = buffer;
    ctx->saved_data["padded_weight"] = padded_weight;
    ctx->saved_data["vocab"] = vocab;
    ctx->saved_data["ignore_index"] = ignore_index;
    return loss.sum();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto it = ctx->saved_data.find("logits");
    TORCH_CHECK(it != ctx->saved_data.end(),
                "LinearCrossEntropy's backward runs once (Note [Logits buffer])");
    at::Tensor buffer = it->second.toTensor();
    at::Tensor padded_weight = ctx->saved_data["padded_weight"].toTensor();
    ctx->saved_data.erase(it);
    ctx->saved_data.erase("padded_weight");
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &hidden = saved[0], &targets = saved[1], &lse = saved[2];
    const int64_t rows = hidden.size(0), vocab = ctx->saved_data["vocab"].toInt(),
                  ld = buffer.size(1);
    at::Tensor scale = grads[0].to(at::kFloat).contiguous();
    c10::cuda::CUDAGuard guard(hidden.device());
    Check(cuda::LaunchCrossEntropy(
              IsBf16(hidden), true, buffer.data_ptr(), ld, rows, vocab, targets.data_ptr<int64_t>(),
              ctx->saved_data["ignore_index"].toInt(), const_cast<float*>(lse.data_ptr<float>()),
              nullptr, scale.data_ptr<float>(), c10::cuda::getCurrentCUDAStream()),
          "cross entropy backward");
    at::Tensor dh, dw;  // buffer: (rows, ld), the padding columns 0
    if (ctx->needs_input_grad(0)) dh = at::mm(buffer, padded_weight);
    if (ctx->needs_input_grad(1)) dw = at::mm(buffer.t(), hidden).narrow(0, 0, vocab);
    return {dh, dw, at::Tensor(), at::Tensor()};
  }
};
}  // namespace

bool RmsNormDifferentiableSupported(const at::Tensor& x, const at::Tensor& weight) {
  return FusedKernelsAvailable(x) && weight.defined() && weight.scalar_type() == x.scalar_type() &&
         weight.device() == x.device() && x.dim() >= 1 && weight.numel() == x.size(-1) &&
         (x.numel() == 0 || cuda::RmsNormBackwardBlocks(1, x.size(-1)) > 0);
}

at::Tensor RmsNormDifferentiable(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(
      RmsNormDifferentiableSupported(x, weight),
      "RmsNormDifferentiable: needs a CUDA tensor, a weight of its dtype and hidden <= 4096");
  return RmsNormFunction::apply(x, weight, eps);
}

std::pair<at::Tensor, at::Tensor> RotaryDifferentiable(const at::Tensor& q, const at::Tensor& k,
                                                       const at::Tensor& cos,
                                                       const at::Tensor& sin) {
  TORCH_CHECK(FusedKernelsAvailable(q) && k.scalar_type() == q.scalar_type() && q.dim() == 4 &&
                  k.dim() == 4 && q.size(3) % 2 == 0,
              "RotaryDifferentiable: q, k (B, T, heads, D) float32/bfloat16 on CUDA");
  const int64_t b = q.size(0), t = q.size(1), d = q.size(3);
  TORCH_CHECK(k.size(0) == b && k.size(1) == t && k.size(3) == d,
              "RotaryDifferentiable: q and k must share B, T and D");
  at::Tensor c = cos.to(at::kFloat).expand({b, t, d}).contiguous();
  at::Tensor s = sin.to(at::kFloat).expand({b, t, d}).contiguous();
  variable_list out = RotaryFunction::apply(q, k, c, s);
  return {out[0], out[1]};
}

at::Tensor BiasAdd(const at::Tensor& x, const at::Tensor& bias) {
  const int64_t vec = x.scalar_type() == at::kBFloat16 ? 8 : 4;
  auto aligned = [](const at::Tensor& t) {
    return !t.is_contiguous() || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  };
  const bool kernel = FusedKernelsAvailable(x) && bias.defined() && bias.dim() == 1 &&
                      bias.scalar_type() == x.scalar_type() && bias.device() == x.device() &&
                      x.dim() >= 1 && x.size(-1) == bias.numel() && bias.numel() % vec == 0 &&
                      aligned(x) && bias.is_contiguous() && aligned(bias);
  if (!kernel) return x + bias;
  return BiasAddFunction::apply(x, bias);
}

at::Tensor ArgmaxRows(const at::Tensor& x) {
  if (x.dim() != 2) return x.argmax(-1);
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  ArgmaxRowsInto(x, out);
  return out;
}

void ArgmaxRowsInto(const at::Tensor& x, const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 1 && out.size(0) == x.size(0) &&
                  out.scalar_type() == at::kLong && out.is_contiguous() &&
                  out.device() == x.device(),
              "ArgmaxRowsInto: x (rows, n) and out (rows) int64, contiguous, on x's device");
  if (!FusedKernelsAvailable(x) || x.stride(1) != 1 || x.size(1) == 0 ||
      x.stride(0) < x.size(1) || x.size(1) > INT32_MAX) {
    at::argmax_out(const_cast<at::Tensor&>(out), x, -1);
    return;
  }
  c10::cuda::CUDAGuard guard(x.device());
  Check(cuda::LaunchArgmax(IsBf16(x), x.data_ptr(), x.stride(0), x.size(0), x.size(1),
                           out.data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream()),
        "argmax");
}

bool LinearCrossEntropySupported(const at::Tensor& hidden, const at::Tensor& weight) {
  return FusedKernelsAvailable(hidden) && hidden.dim() == 2 && weight.dim() == 2 &&
         weight.scalar_type() == hidden.scalar_type() && weight.device() == hidden.device() &&
         weight.size(1) == hidden.size(1) && weight.size(0) <= INT32_MAX;
}

at::Tensor LinearCrossEntropy(const at::Tensor& hidden, const at::Tensor& weight,
                              const at::Tensor& targets, int64_t ignore_index) {
  TORCH_CHECK(LinearCrossEntropySupported(hidden, weight),
              "LinearCrossEntropy: hidden (rows, H) and weight (vocab, H) of one dtype "
              "(float32/bfloat16) on one CUDA device");
  TORCH_CHECK(targets.scalar_type() == at::kLong && targets.device() == hidden.device() &&
                  targets.numel() == hidden.size(0),
              "LinearCrossEntropy: targets must be int64 on the device, one per row");
  return LinearCrossEntropyFunction::apply(hidden, weight, targets.reshape({-1}), ignore_index);
}

}  // namespace vlmgraph::ops
