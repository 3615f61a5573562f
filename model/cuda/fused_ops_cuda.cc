// model/cuda/fused_ops_cuda.cc: ATen wrappers of the fused kernels (see model/fused_ops.h).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

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

RopeKvOutput RopeKvWrite(const at::Tensor& qkv, const at::Tensor& inv_freq, double scaling,
                         const at::Tensor& positions, const at::Tensor& slots, int64_t n_heads,
                         int64_t n_kv, const at::Tensor& cache_k, const at::Tensor& cache_v,
                         bool want_k) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous(),
              "qkv must be contiguous (B, T, (nh + 2 nkv) D)");
  const int64_t b = qkv.size(0), t = qkv.size(1);
  const int64_t d = qkv.size(2) / (n_heads + 2 * n_kv);
  TORCH_CHECK(inv_freq.scalar_type() == at::kFloat && inv_freq.numel() == d / 2,
              "inv_freq must be (D/2) float32");
  RopeKvOutput out;
  out.q = at::empty({b, t, n_heads, d}, qkv.options());
  if (want_k) out.k = at::empty({b, t, n_kv, d}, qkv.options());
  int64_t max_seq = 0;
  if (cache_k.defined()) {
    TORCH_CHECK(cache_k.is_contiguous() && cache_v.is_contiguous() &&
                    cache_k.scalar_type() == qkv.scalar_type(),
                "KV cache must be contiguous and in the activations' dtype");
    max_seq = cache_k.size(2);
  }
  at::Tensor freq = inv_freq.contiguous();
  c10::cuda::CUDAGuard guard(qkv.device());
  Check(cuda::LaunchRopeKvWrite(IsBf16(qkv), qkv.data_ptr(), freq.data_ptr<float>(),
                                static_cast<float>(scaling), OptionalLongPtr(positions),
                                OptionalLongPtr(slots), b, t, n_heads, n_kv, d, out.q.data_ptr(),
                                want_k ? out.k.data_ptr() : nullptr,
                                cache_k.defined() ? cache_k.data_ptr() : nullptr,
                                cache_v.defined() ? cache_v.data_ptr() : nullptr, max_seq,
                                c10::cuda::getCurrentCUDAStream()),
        "rope_kv_write");
  return out;
}

at::Tensor DecodeAttention(const at::Tensor& q, const at::Tensor& cache_k,
                           const at::Tensor& cache_v, const at::Tensor& positions, int64_t kv_len,
                           int64_t n_heads) {
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous(), "q must be contiguous (B, n_heads * D)");
  TORCH_CHECK(cache_k.is_contiguous() && cache_v.is_contiguous(), "KV cache must be contiguous");
  const int64_t b = q.size(0), n_kv = cache_k.size(1), d = cache_k.size(3);
  TORCH_CHECK(q.size(1) == n_heads * d && cache_k.size(0) >= b && kv_len <= cache_k.size(2),
              "decode attention shapes");
  at::Tensor out = at::empty_like(q);
  c10::cuda::CUDAGuard guard(q.device());
  Check(cuda::LaunchDecodeAttention(IsBf16(q), q.data_ptr(), cache_k.data_ptr(), cache_v.data_ptr(),
                                    OptionalLongPtr(positions), out.data_ptr(), b, n_heads, n_kv, d,
                                    cache_k.size(2), kv_len,
                                    static_cast<float>(1.0 / std::sqrt(static_cast<double>(d))),
                                    c10::cuda::getCurrentCUDAStream()),
        "decode_attention");
  return out;
}

// Measured on an H200 at nanovlm-460m shapes (bench/decode_ops_bench.cc): the GEMV kernel beats
// cuBLAS up to 4 rows (down projection 3.2 us vs 9.6 us at 1 row) and loses at 8.
constexpr int64_t kMaxGemvRows = 4;

at::Tensor Linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& residual) {
  const int64_t k = x.size(-1), n = weight.size(0);
  const int64_t rows = x.numel() / k;
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = n;
  if (rows <= kMaxGemvRows && x.is_contiguous() && weight.is_contiguous() &&
      (!residual.defined() || residual.is_contiguous()) &&
      weight.scalar_type() == x.scalar_type()) {
    at::Tensor y = at::empty(out_sizes, x.options());
    c10::cuda::CUDAGuard guard(x.device());
    if (cuda::LaunchSmallBatchGemv(IsBf16(x), x.data_ptr(), weight.data_ptr(),
                                   residual.defined() ? residual.data_ptr() : nullptr, y.data_ptr(),
                                   rows, n, k, c10::cuda::getCurrentCUDAStream()) == cudaSuccess) {
      return y;
    }
    (void)cudaGetLastError();  // unaligned shapes: fall through to cuBLAS
  }
  if (!residual.defined()) return at::linear(x, weight);
  return at::addmm(residual.reshape({rows, n}), x.reshape({rows, k}), weight.t()).view(out_sizes);
}

}  // namespace vlmgraph::ops
