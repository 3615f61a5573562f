// bench/decode_ops_bench.cc: device time of each op of one decode step of a decoder block, at the
// nanovlm-460m shapes in bfloat16, each op captured 64 times back to back in a CUDA graph and the
// graph replayed 20 times (so the figure is kernel time plus in-graph launch gaps, no host cost).
// The projections cycle through 32 copies of their weights, so that, as in a real step, weights
// stream from device memory rather than sit in L2. Top rows: the fused path a decode step runs
// (model/fused_ops.h); bottom rows: the unfused reference (separate kernels, cuBLAS).
// VLMGRAPH_PDL=0 turns programmatic dependent launch off for comparison.
// The last table runs the whole decoder (all blocks, distinct weights per block) both ways: the
// per-block kernels above, and the one-kernel stack (ops::DecodeStack), with the stack's per-stage
// timeline (median over blocks and layers of the globaltimer marks it records).
//
//   vlmgraph-decode-ops-bench [--batch 1] [--context 512] [--length 130]
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "model/fused_ops.h"
#include "model/vision_language_model.h"

namespace {

constexpr int kCalls = 64, kCopies = 32;

double TimeOp(const std::function<void(int)>& op) {
  auto stream = c10::cuda::getStreamFromPool();
  c10::cuda::CUDAStreamGuard guard(stream);
  for (int i = 0; i < 3; ++i) op(i);
  stream.synchronize();
  at::cuda::CUDAGraph graph;
  graph.capture_begin();
  for (int i = 0; i < kCalls; ++i) op(i);
  graph.capture_end();
  graph.replay();
  stream.synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 20; ++i) graph.replay();
  stream.synchronize();
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
         (20 * kCalls);
}

std::vector<at::Tensor> Copies(const std::vector<int64_t>& shape, const at::TensorOptions& opt) {
  std::vector<at::Tensor> v;
  for (int i = 0; i < kCopies; ++i) v.push_back(at::randn(shape, opt) * 0.02);
  return v;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

// All blocks of the decoder for one token per row: per-block kernels vs the one-kernel stack.
void WholeDecoder(const vlmgraph::VlmConfig& cfg, int64_t batch, int64_t context, int64_t length) {
  using namespace vlmgraph;
  const int64_t h = cfg.lm_hidden_dim, nh = cfg.lm_n_heads, nkv = cfg.lm_n_kv_heads,
                d = cfg.lm_head_dim(), inter = cfg.lm_inter_dim, layers = cfg.lm_n_blocks;
  auto opt = at::dtype(at::kBFloat16).device(at::kCUDA);
  ops::DecodeStackWeights w;
  for (int64_t l = 0; l < layers; ++l) {
    w.norm1.push_back(at::ones({h}, opt));
    w.norm2.push_back(at::ones({h}, opt));
    w.w_qkv.push_back(at::randn({(nh + 2 * nkv) * d, h}, opt) * 0.02);
    w.w_out.push_back(at::randn({h, nh * d}, opt) * 0.02);
    w.w_gate_up.push_back(at::randn({2 * inter, h}, opt) * 0.02);
    w.w_down.push_back(at::randn({h, inter}, opt) * 0.02);
    w.cache_k.push_back(at::randn({batch + 1, nkv, context, d}, opt));
    w.cache_v.push_back(at::randn({batch + 1, nkv, context, d}, opt));
  }
  at::Tensor x = at::randn({batch, h}, opt);
  at::Tensor inv_freq = at::rand({d / 2}, at::dtype(at::kFloat).device(at::kCUDA));
  auto ints = at::dtype(at::kInt).device(at::kCUDA);
  at::Tensor semaphores = at::zeros({batch + 1, nkv}, ints), barrier = at::zeros({1}, ints);
  at::Tensor pos = at::full({batch}, length, at::dtype(at::kLong).device(at::kCUDA));
  auto per_block = [&](int) {
    at::Tensor y = x;
    for (int64_t l = 0; l < layers; ++l) {
      at::Tensor qkv = ops::RmsNormLinear(y, w.norm1[l], 1e-5, w.w_qkv[l]);
      at::Tensor a = ops::RopeDecodeAttention(qkv, inv_freq, 1.0, pos, w.cache_k[l],
                                              w.cache_v[l], semaphores, context, nh);
      at::Tensor r = ops::Linear(a, w.w_out[l], y);
      at::Tensor gu = ops::RmsNormLinear(r, w.norm2[l], 1e-5, w.w_gate_up[l]);
      y = ops::SiluMulLinear(gu, w.w_down[l], r);
    }
  };
  auto stack = [&](int) {
    at::Tensor y =
        ops::DecodeStack(x, w, pos, context, inv_freq, 1.0, 1e-5, nh, semaphores, barrier);
    TORCH_CHECK(y.defined(), "the one-kernel stack does not apply here");
  };
  std::printf("\nwhole decoder, %lld blocks, batch %lld\n| path | us per step |\n|---|---|\n",
              (long long)layers, (long long)batch);
  std::printf("| per-block kernels | %.1f |\n", TimeOp(per_block));
  ops::SetDecodeStackEnabled(true);  // experimental, off by default
  std::printf("| one-kernel stack | %.1f |\n", TimeOp(stack));
  // Timeline of one eager launch.
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  constexpr int kPoints = 30;
  at::Tensor trace = at::zeros({sms, layers, kPoints}, at::dtype(at::kLong).device(at::kCUDA));
  ops::DecodeStack(x, w, pos, context, inv_freq, 1.0, 1e-5, nh, semaphores, barrier, trace);
  at::Tensor t = trace.cpu();
  const int64_t* v = t.data_ptr<int64_t>();
  auto at_ = [&](int b, int64_t l, int k) { return double(v[(b * layers + l) * kPoints + k]); };
  const char* names[] = {"A qkv", "B attention", "C out", "D gate_up", "E down"};
  std::printf("\nstack timeline (us, median over blocks x layers; d1..d4 between the stage's marks,"
              " see kDecodeStackTracePoints)\n"
              "| stage | d1 | d2 | d3 | d4 | arrive | arrived to next pass | pass to arrive "
              "max |\n|---|---|---|---|---|---|---|---|\n");
  for (int st = 0; st < 5; ++st) {
    std::vector<double> d[6], span;
    for (int b = 0; b < sms; ++b) {
      for (int64_t l = 0; l < layers; ++l) {
        for (int k = 0; k < 4; ++k) {
          const double x0 = at_(b, l, 5 * st + k), x1 = at_(b, l, 5 * st + k + 1);
          if (x0 > 0 && x1 > 0) d[k].push_back((x1 - x0) / 1e3);
        }
        const double arrived = at_(b, l, 25 + st);
        if (arrived > 0) d[4].push_back((arrived - at_(b, l, 5 * st + 4)) / 1e3);
        const bool last = st == 4 && l + 1 == layers;
        if (!last && arrived > 0) {
          const double next = st == 4 ? at_(b, l + 1, 0) : at_(b, l, 5 * (st + 1));
          d[5].push_back((next - arrived) / 1e3);
        }
        span.push_back((at_(b, l, 5 * st + 4) - at_(b, l, 5 * st)) / 1e3);
      }
    }
    std::printf("| %s | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |\n", names[st],
                Median(d[0]), Median(d[1]), Median(d[2]), Median(d[3]), Median(d[4]),
                Median(d[5]), *std::max_element(span.begin(), span.end()));
  }
  double first = 1e300, last = 0;
  for (int b = 0; b < sms; ++b) {
    first = std::min(first, at_(b, 0, 0));
    last = std::max(last, at_(b, layers - 1, 24));
  }
  std::printf("| total (first pass to last arrive) | %.1f us | %.2f us per layer | |\n",
              (last - first) / 1e3, (last - first) / 1e3 / layers);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t batch = 1, context = 512, length = 130;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    if (k == "--batch") batch = std::stoll(argv[i + 1]);
    if (k == "--context") context = std::stoll(argv[i + 1]);
    if (k == "--length") length = std::stoll(argv[i + 1]);
  }
  if (!torch::cuda::is_available()) {
    std::fprintf(stderr, "needs a CUDA device\n");
    return 1;
  }
  at::NoGradGuard no_grad;
  const auto cfg = vlmgraph::VlmConfig::Preset("nanovlm-460m");
  const int64_t h = cfg.lm_hidden_dim, nh = cfg.lm_n_heads, nkv = cfg.lm_n_kv_heads,
                d = cfg.lm_head_dim(), inter = cfg.lm_inter_dim;
  auto opt = at::dtype(at::kBFloat16).device(at::kCUDA);
  at::Tensor x = at::randn({batch, 1, h}, opt), x2 = x.view({batch, h});
  at::Tensor w_norm = at::ones({h}, opt);
  const auto w_qkv = Copies({(nh + 2 * nkv) * d, h}, opt);
  const auto w_out = Copies({h, nh * d}, opt);
  const auto w_gu = Copies({2 * inter, h}, opt);
  const auto w_down = Copies({h, inter}, opt);
  at::Tensor head = at::randn({cfg.lm_vocab_size, h}, opt) * 0.02;
  at::Tensor inv_freq = at::rand({d / 2}, at::dtype(at::kFloat).device(at::kCUDA));
  at::Tensor ck = at::randn({batch + 1, nkv, context, d}, opt), cv = at::randn_like(ck);
  at::Tensor semaphores = at::zeros({batch + 1, nkv}, at::dtype(at::kInt).device(at::kCUDA));
  at::Tensor pos = at::full({batch}, length, at::dtype(at::kLong).device(at::kCUDA));
  at::Tensor qkv = at::linear(x2, w_qkv[0]);  // (batch, (nh + 2 nkv) d)
  at::Tensor a = at::randn({batch, nh * d}, opt);
  at::Tensor gu = at::linear(x2, w_gu[0]), act = vlmgraph::ops::SiluMul(gu);
  using vlmgraph::ops::Linear;
  struct Row {
    const char* name;
    bool in_block;  // counted in the fused block's sum
    std::function<void(int)> op;
  };
  const Row rows[] = {
      {"qkv: rms_norm + gemv", true,
       [&](int i) { vlmgraph::ops::RmsNormLinear(x2, w_norm, 1e-5, w_qkv[i % kCopies]); }},
      {"attention: rope + kv write + split-key attention", true,
       [&](int) {
         vlmgraph::ops::RopeDecodeAttention(qkv, inv_freq, 1.0, pos, ck, cv, semaphores, context,
                                            nh);
       }},
      {"out: gemv + residual", true, [&](int i) { Linear(a, w_out[i % kCopies], x2); }},
      {"gate_up: rms_norm + gemv", true,
       [&](int i) { vlmgraph::ops::RmsNormLinear(x2, w_norm, 1e-5, w_gu[i % kCopies]); }},
      {"down: silu_mul + gemv + residual", true,
       [&](int i) { vlmgraph::ops::SiluMulLinear(gu, w_down[i % kCopies], x2); }},
      {"lm head gemv (once per step)", false, [&](int) { Linear(x2, head); }},
      // One weight copy for every call, so the weights stay in L2: what is left is each kernel's
      // launch, dependency and reduction latency. (H100, batch 1: only 0.5-1.2 us below the rows
      // above, so prefetching the next layer's weights into L2 does not pay; tried.)
      {"weights in L2: qkv", false,
       [&](int) { vlmgraph::ops::RmsNormLinear(x2, w_norm, 1e-5, w_qkv[0]); }},
      {"weights in L2: out", false, [&](int) { Linear(a, w_out[0], x2); }},
      {"weights in L2: gate_up", false,
       [&](int) { vlmgraph::ops::RmsNormLinear(x2, w_norm, 1e-5, w_gu[0]); }},
      {"weights in L2: down", false,
       [&](int) { vlmgraph::ops::SiluMulLinear(gu, w_down[0], x2); }},
      {"unfused: rms_norm", false, [&](int) { vlmgraph::ops::RmsNorm(x2, w_norm, 1e-5); }},
      {"unfused: qkv cuBLAS", false, [&](int i) { at::linear(x2, w_qkv[i % kCopies]); }},
      {"unfused: rope + kv write", false,
       [&](int) {
         vlmgraph::ops::RopeKvWrite(qkv.view({batch, 1, -1}), inv_freq, 1.0, pos, {}, nh, nkv, ck,
                                    cv, false);
       }},
      {"unfused: out cuBLAS addmm", false,
       [&](int i) { at::addmm(x2, a, w_out[i % kCopies].t()); }},
      {"unfused: gate_up cuBLAS", false, [&](int i) { at::linear(x2, w_gu[i % kCopies]); }},
      {"unfused: silu_mul", false, [&](int) { vlmgraph::ops::SiluMul(gu); }},
      {"unfused: down cuBLAS addmm", false,
       [&](int i) { at::addmm(x2, act, w_down[i % kCopies].t()); }},
      {"unfused: lm head cuBLAS", false, [&](int) { at::linear(x2, head); }},
  };
  double layer = 0;
  std::printf("batch %lld, context bucket %lld, keys %lld (bf16, nanovlm-460m shapes)\n",
              (long long)batch, (long long)context, (long long)length + 1);
  std::printf("| op | us |\n|---|---|\n");
  double head_us = 0;
  for (const auto& r : rows) {
    const double us = TimeOp(r.op);
    if (r.in_block) layer += us;
    if (std::string(r.name).rfind("lm head", 0) == 0) head_us = us;
    std::printf("| %s | %.2f |\n", r.name, us);
  }
  std::printf("| fused block (sum) | %.2f |\n| %lld fused blocks + head | %.1f |\n", layer,
              (long long)cfg.lm_n_blocks, layer * cfg.lm_n_blocks + head_us);
  WholeDecoder(cfg, batch, context, length);
  return 0;
}
