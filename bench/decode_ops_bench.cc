// bench/decode_ops_bench.cc: device time of each op of one decode step of a decoder block, at the
// nanovlm-460m shapes in bfloat16, each op captured 50 times back to back in a CUDA graph and the
// graph replayed 20 times (so the figure is kernel time plus in-graph launch gaps, no host cost).
//
//   vlmgraph-decode-ops-bench [--batch 1] [--context 512] [--length 130]
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/cuda.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <string>

#include "model/fused_ops.h"
#include "model/vision_language_model.h"

namespace {

double TimeOp(const std::function<void()>& op) {
  auto stream = c10::cuda::getStreamFromPool();
  c10::cuda::CUDAStreamGuard guard(stream);
  for (int i = 0; i < 3; ++i) op();
  stream.synchronize();
  at::cuda::CUDAGraph graph;
  graph.capture_begin();
  for (int i = 0; i < 50; ++i) op();
  graph.capture_end();
  graph.replay();
  stream.synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 20; ++i) graph.replay();
  stream.synchronize();
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
         (20 * 50);
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
  at::Tensor w_qkv = at::randn({(nh + 2 * nkv) * d, h}, opt) * 0.02;
  at::Tensor w_out = at::randn({h, h}, opt) * 0.02;
  at::Tensor w_gu = at::randn({2 * inter, h}, opt) * 0.02;
  at::Tensor w_down = at::randn({h, inter}, opt) * 0.02;
  at::Tensor head = at::randn({cfg.lm_vocab_size, h}, opt) * 0.02;
  at::Tensor inv_freq = at::rand({d / 2}, at::dtype(at::kFloat).device(at::kCUDA));
  at::Tensor ck = at::randn({batch + 1, nkv, context, d}, opt), cv = at::randn_like(ck);
  at::Tensor pos = at::full({batch}, length, at::dtype(at::kLong).device(at::kCUDA));
  at::Tensor qkv = at::linear(x, w_qkv);
  at::Tensor q = at::randn({batch, nh * d}, opt);
  at::Tensor gu = at::linear(x, w_gu), act = vlmgraph::ops::SiluMul(gu);
  struct Row {
    const char* name;
    std::function<void()> op;
  };
  Row rows[] = {
      {"rms_norm", [&] { vlmgraph::ops::RmsNorm(x, w_norm, 1e-5); }},
      {"qkv linear", [&] { at::linear(x, w_qkv); }},
      {"rope + kv write",
       [&] { vlmgraph::ops::RopeKvWrite(qkv, inv_freq, 1.0, pos, {}, nh, nkv, ck, cv, false); }},
      {"decode attention", [&] { vlmgraph::ops::DecodeAttention(q, ck, cv, pos, context, nh); }},
      {"out addmm", [&] { at::addmm(x2, q.narrow(1, 0, h), w_out.t()); }},
      {"gate_up linear", [&] { at::linear(x, w_gu); }},
      {"silu_mul", [&] { vlmgraph::ops::SiluMul(gu); }},
      {"down addmm",
       [&] {
         at::addmm(x2, act.view({batch, inter}), w_down.t());
       }},
      {"  gemv kernel: qkv", [&] { vlmgraph::ops::Linear(x2, w_qkv); }},
      {"  gemv kernel: out + residual",
       [&] { vlmgraph::ops::Linear(q.narrow(1, 0, h).contiguous(), w_out, x2); }},
      {"  gemv kernel: gate_up", [&] { vlmgraph::ops::Linear(x2, w_gu); }},
      {"  gemv kernel: down + residual",
       [&] {
         vlmgraph::ops::Linear(act.view({batch, inter}), w_down, x2);
       }},
      {"  gemv kernel: lm head", [&] { vlmgraph::ops::Linear(x2, head); }},
      {"  alt: down linear",
       [&] {
         at::linear(act.view({batch, inter}), w_down);
       }},
      {"  alt: down matmul W @ a^T",
       [&] {
         at::matmul(w_down, act.view({batch, inter}).t());
       }},
      {"  alt: out linear", [&] { at::linear(q.narrow(1, 0, h), w_out); }},
      {"  alt: qkv matmul W @ x^T", [&] { at::matmul(w_qkv, x2.t()); }},
      {"lm head (once per step)", [&] { at::linear(x2, head); }},
  };
  double layer = 0;
  std::printf("batch %lld, context bucket %lld, keys %lld (bf16, nanovlm-460m shapes)\n",
              (long long)batch, (long long)context, (long long)length + 1);
  std::printf("| op | us |\n|---|---|\n");
  for (const auto& r : rows) {
    const double us = TimeOp(r.op);
    const std::string name = r.name;
    if (name.find("head") == std::string::npos && name.find("alt:") == std::string::npos &&
        name.find("gemv") == std::string::npos)
      layer += us;
    std::printf("| %s | %.2f |\n", r.name, us);
  }
  std::printf("| one block (sum) | %.2f |\n| %lld blocks + head | %.1f |\n", layer,
              (long long)cfg.lm_n_blocks, layer * cfg.lm_n_blocks);
  return 0;
}
