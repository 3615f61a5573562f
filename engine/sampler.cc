#include "engine/sampler.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "engine/device.h"
#include "engine/sampler_formulas.h"

namespace vlmgraph {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// NucleusPrefix on the CPU (the CUDA kernel in engine/cuda/sampler_kernels.cu sums the same terms
// in a different order).
template <typename T>
void NucleusPrefixCpu(const at::Tensor& sorted, const SamplingRows& rows, const at::Tensor& kept) {
  const int64_t n = sorted.size(0), cols = sorted.size(1);
  const T* x = sorted.data_ptr<T>();
  const float* top_p = rows.top_p.data_ptr<float>();
  const int64_t* top_k = rows.top_k.data_ptr<int64_t>();
  int64_t* o = kept.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * cols;
      const int64_t n_k = TopKPrefix(xr, cols, top_k[r]);
      o[r] = n_k;
      if (!(top_p[r] < 1.f)) continue;
      const float x0 = static_cast<float>(xr[0]);
      double total = 0.0;
      for (int64_t j = 0; j < n_k; ++j) total += std::exp(static_cast<float>(xr[j]) - x0);
      const double limit = static_cast<double>(top_p[r]) * total;
      double before = 0.0;
      for (int64_t j = 1; j < n_k; ++j) {
        before += std::exp(static_cast<float>(xr[j - 1]) - x0);
        if (before > limit) {
          o[r] = j;
          break;
        }
      }
    }
  });
}

// GumbelMaxDraw on the CPU: the CUDA kernel's loop (engine/cuda/sampler_kernels.cu), one row at a
// time.
template <typename T>
void GumbelMaxDrawCpu(const at::Tensor& candidates, const at::Tensor& ids, const at::Tensor& kept,
                      const SamplingRows& rows, const at::Tensor& out) {
  const int64_t n = candidates.size(0), cols = candidates.size(1);
  const T* x = candidates.data_ptr<T>();
  const int64_t* id = ids.defined() ? ids.data_ptr<int64_t>() : nullptr;
  const int64_t* kept_p = kept.defined() ? kept.data_ptr<int64_t>() : nullptr;
  const float* temperature = rows.temperature.data_ptr<float>();
  const int64_t* seed = rows.seed.data_ptr<int64_t>();
  const int64_t* draw = rows.draw.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * cols;
      const int64_t end = kept_p ? std::min(std::max<int64_t>(kept_p[r], 1), cols) : cols;
      float best = kNegInf;
      int64_t best_id = std::numeric_limits<int64_t>::max();
      for (int64_t j = 0; j < end; ++j) {
        const int64_t t = id ? id[r * cols + j] : j;
        const float s =
            SamplingScore(static_cast<float>(xr[j]), temperature[r], static_cast<uint64_t>(seed[r]),
                          static_cast<uint64_t>(draw[r]), t);
        if (SamplingBeats(s, t, best, best_id)) {
          best = s;
          best_id = t;
        }
      }
      // Only NaN scores lose to the initial value: fall back to the first candidate.
      o[r] = best_id != std::numeric_limits<int64_t>::max() ? best_id : (id ? id[r * cols] : 0);
    }
  });
}

// Checks shared by NucleusPrefix and GumbelMaxDraw.
void CheckSamplingArgs(const char* op, const at::Tensor& candidates, const SamplingRows& rows,
                       const at::Tensor& out) {
  TORCH_CHECK(
      candidates.dim() == 2 && candidates.size(1) > 0 && candidates.is_contiguous() &&
          (candidates.scalar_type() == at::kFloat || candidates.scalar_type() == at::kBFloat16),
      op, ": the logits must be a contiguous (rows, C > 0) float32 or bfloat16 tensor");
  const int64_t n = candidates.size(0);
  auto check = [&](const at::Tensor& t, at::ScalarType dtype, const char* what) {
    TORCH_CHECK(t.defined() && t.device() == candidates.device() && t.scalar_type() == dtype &&
                    t.is_contiguous() && t.dim() == 1 && t.size(0) == n,
                op, ": ", what, " must be a contiguous (", n, ") ", dtype, " tensor on ",
                candidates.device());
  };
  check(rows.temperature, at::kFloat, "temperature");
  check(rows.top_p, at::kFloat, "top_p");
  check(rows.top_k, at::kLong, "top_k");
  check(rows.seed, at::kLong, "seed");
  check(rows.draw, at::kLong, "draw");
  check(out, at::kLong, "the output");
}

}  // namespace

void NucleusPrefix(const at::Tensor& sorted, const SamplingRows& rows, const at::Tensor& kept) {
  CheckSamplingArgs("NucleusPrefix", sorted, rows, kept);
  if (sorted.size(0) == 0) return;
  if (sorted.is_cuda()) {
    NucleusPrefixCuda(sorted, rows, kept);
  } else if (sorted.scalar_type() == at::kFloat) {
    NucleusPrefixCpu<float>(sorted, rows, kept);
  } else {
    NucleusPrefixCpu<at::BFloat16>(sorted, rows, kept);
  }
}

void GumbelMaxDraw(const at::Tensor& candidates, const at::Tensor& ids, const at::Tensor& kept,
                   const SamplingRows& rows, const at::Tensor& out) {
  CheckSamplingArgs("GumbelMaxDraw", candidates, rows, out);
  TORCH_CHECK(ids.defined() == kept.defined(),
              "GumbelMaxDraw: ids and kept go together (sorted candidates) or are both undefined");
  if (ids.defined()) {
    TORCH_CHECK(ids.device() == candidates.device() && ids.scalar_type() == at::kLong &&
                    ids.is_contiguous() && ids.sizes() == candidates.sizes(),
                "GumbelMaxDraw: ids must be a contiguous int64 tensor shaped as the candidates");
    TORCH_CHECK(kept.device() == candidates.device() && kept.scalar_type() == at::kLong &&
                    kept.is_contiguous() && kept.dim() == 1 && kept.size(0) == candidates.size(0),
                "GumbelMaxDraw: kept must be a contiguous (rows) int64 tensor");
  }
  if (candidates.size(0) == 0) return;
  if (candidates.is_cuda()) {
    GumbelMaxDrawCuda(candidates, ids, kept, rows, out);
  } else if (candidates.scalar_type() == at::kFloat) {
    GumbelMaxDrawCpu<float>(candidates, ids, kept, rows, out);
  } else {
    GumbelMaxDrawCpu<at::BFloat16>(candidates, ids, kept, rows, out);
  }
}

void SampleRowsInto(const at::Tensor& logits, const std::vector<SamplingDraw>& draws,
                    const at::Tensor& tokens) {
  if (draws.empty()) return;
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "SampleRowsInto: logits must be (B, V)");
  TORCH_CHECK(tokens.dim() == 1 && tokens.size(0) == logits.size(0) &&
                  tokens.scalar_type() == at::kLong && tokens.device() == logits.device(),
              "SampleRowsInto: tokens must be (B) int64 on the logits' device");
  const int64_t batch = logits.size(0), vocab = logits.size(1);
  const auto n = static_cast<int64_t>(draws.size());
  const at::Device device = logits.device();
  // The rows' parameters in one table, (row, top_k, seed, draw) as int64 then (temperature,
  // top_p) as float32, copied in one go, asynchronously from pinned memory on CUDA (the caching
  // host allocator keeps the block until its copy has run).
  at::Tensor host = at::empty({n * (4 * 8 + 2 * 4)},
                              at::TensorOptions().dtype(at::kByte).pinned_memory(device.is_cuda()));
  int64_t* p = reinterpret_cast<int64_t*>(host.data_ptr<uint8_t>());
  float* f = reinterpret_cast<float*>(p + 4 * n);
  bool filter = false;
  for (int64_t k = 0; k < n; ++k) {
    const SamplingDraw& d = draws[static_cast<size_t>(k)];
    TORCH_CHECK(d.params != nullptr && d.row >= 0 && d.row < batch, "SampleRowsInto: draw ", k,
                " needs parameters and a row in [0, ", batch, ")");
    const SamplingParams& s = *d.params;
    const int64_t top_k = s.top_k > 0 && s.top_k < vocab ? s.top_k : 0;  // >= V keeps all
    filter = filter || top_k > 0 || s.top_p < 1.0;
    p[k] = d.row;
    p[n + k] = top_k;
    p[2 * n + k] = static_cast<int64_t>(s.seed);
    p[3 * n + k] = d.draw;
    f[k] = static_cast<float>(s.temperature);
    f[n + k] = static_cast<float>(s.top_p);
  }
  const at::Tensor table = host.to(device, /*non_blocking=*/true);
  const at::Tensor ints = table.narrow(0, 0, 4 * 8 * n).view(at::kLong);
  const at::Tensor floats = table.narrow(0, 4 * 8 * n, 2 * 4 * n).view(at::kFloat);
  const at::Tensor rows = ints.narrow(0, 0, n);
  const SamplingRows params{floats.narrow(0, 0, n), floats.narrow(0, n, n), ints.narrow(0, n, n),
                            ints.narrow(0, 2 * n, n), ints.narrow(0, 3 * n, n)};
  at::Tensor x = logits.index_select(0, rows);  // (n, V), the logits' dtype
  if (x.scalar_type() != at::kFloat && x.scalar_type() != at::kBFloat16) x = x.to(at::kFloat);
  at::Tensor out = at::empty({n}, tokens.options());
  if (!filter) {
    GumbelMaxDraw(x, at::Tensor(), at::Tensor(), params, out);
  } else {
    // Stable: equal logits keep their vocabulary order, on the CPU and on CUDA alike.
    auto [sorted, ids] = at::sort(x, /*stable=*/true, /*dim=*/-1, /*descending=*/true);
    at::Tensor kept = at::empty({n}, tokens.options());
    NucleusPrefix(sorted, params, kept);
    GumbelMaxDraw(sorted, ids, kept, params, out);
  }
  tokens.index_copy_(0, rows, out);
}

}  // namespace vlmgraph
