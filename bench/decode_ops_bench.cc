// bench/decode_ops_bench.cc: device time of each op of one decode step of a decoder block, at the
// nanovlm-460m shapes in bfloat16, each op captured 64 times back to back in a CUDA graph and the
// graph replayed 20 times (so the figure is kernel time plus in-graph launch gaps, no host cost).
// The projections cycle through 32 copies of their weights, so that, as in a real step, weights
// stream from device memory rather than sit in L2. Top rows: the fused path a decode step runs
// (model/fused_ops.h); bottom rows: the unfused reference (separate kernels, cuBLAS).
// VLMGRAPH_PDL=0 turns programmatic dependent launch off for comparison.
// The last table runs the whole decoder (all blocks, distinct weights per block) with the per-block
// kernels above, with the attention kernel combining its key splits and, up to 4 rows, with the
// out projection combining them (ops::AttentionCombineLinear; Decode takes it up to 2 rows).
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

// A paged KV cache of batch + 1 rows of `context` positions (Note [Paged KV layout],
// model/kv_cache.h): the keys' or values' shape, and the page table giving each row its own pages.
std::vector<int64_t> PagedShape(int64_t batch, int64_t nkv, int64_t context, int64_t d) {
  const int64_t ps = vlmgraph::kDefaultKvPageSize;
  return {(batch + 1) * vlmgraph::KvPagesFor(context, ps) + 1, nkv, ps, d};
}
at::Tensor RowPages(int64_t batch, int64_t context) {
  const int64_t per_row = vlmgraph::KvPagesFor(context, vlmgraph::kDefaultKvPageSize);
  return at::arange(1, (batch + 1) * per_row + 1, at::dtype(at::kInt).device(at::kCUDA))
      .view({batch + 1, per_row});
}

// All blocks of the decoder for one token per row, with distinct weights per block.
void WholeDecoder(const vlmgraph::VlmConfig& cfg, int64_t batch, int64_t context, int64_t length) {
  using namespace vlmgraph;
  const int64_t h = cfg.lm_hidden_dim, nh = cfg.lm_n_heads, nkv = cfg.lm_n_kv_heads,
                d = cfg.lm_head_dim(), inter = cfg.lm_inter_dim, layers = cfg.lm_n_blocks;
  auto opt = at::dtype(at::kBFloat16).device(at::kCUDA);
  struct Block {
    at::Tensor norm1, norm2, w_qkv, w_out, w_gate_up, w_down, cache_k, cache_v;
  };
  std::vector<Block> blocks;
  for (int64_t l = 0; l < layers; ++l) {
    blocks.push_back(
        {at::ones({h}, opt), at::ones({h}, opt), at::randn({(nh + 2 * nkv) * d, h}, opt) * 0.02,
         at::randn({h, nh * d}, opt) * 0.02, at::randn({2 * inter, h}, opt) * 0.02,
         at::randn({h, inter}, opt) * 0.02, at::randn(PagedShape(batch, nkv, context, d), opt),
         at::randn(PagedShape(batch, nkv, context, d), opt)});
  }
  const at::Tensor table = RowPages(batch, context);
  at::Tensor x = at::randn({batch, h}, opt);
  at::Tensor inv_freq = at::rand({d / 2}, at::dtype(at::kFloat).device(at::kCUDA));
  at::Tensor semaphores = at::zeros({batch + 1, nkv}, at::dtype(at::kInt).device(at::kCUDA));
  at::Tensor pos = at::full({batch}, length, at::dtype(at::kLong).device(at::kCUDA));
  // combine_in_out: the out projection combines the attention's partial states (what
  // LanguageModel::Decode takes where ops::DecodeAttentionCombinesInLinear), else the attention
  // kernel's last block per (row, KV head) does.
  auto per_block = [&](bool combine_in_out) {
    return [&, combine_in_out](int) {
      at::Tensor y = x;
      for (const Block& b : blocks) {
        at::Tensor qkv = ops::RmsNormLinear(y, b.norm1, 1e-5, b.w_qkv);
        at::Tensor r;
        if (combine_in_out) {
          r = ops::AttentionCombineLinear(
              ops::RopeDecodeAttentionPartials(qkv, inv_freq, 1.0, pos, b.cache_k, b.cache_v, table,
                                               semaphores, context, nh),
              b.w_out, y);
        } else {
          r = ops::Linear(ops::RopeDecodeAttention(qkv, inv_freq, 1.0, pos, b.cache_k, b.cache_v,
                                                   table, semaphores, context, nh),
                          b.w_out, y);
        }
        at::Tensor gu = ops::RmsNormLinear(r, b.norm2, 1e-5, b.w_gate_up);
        y = ops::SiluMulLinear(gu, b.w_down, r);
      }
    };
  };
  std::printf("\nwhole decoder, %lld blocks, batch %lld\n| path | us per step |\n|---|---|\n",
              (long long)layers, (long long)batch);
  std::printf("| per-block kernels, combine in the attention kernel | %.1f |\n",
              TimeOp(per_block(false)));
  if (batch <= 4) {  // AttentionCombineLinear's limit; Decode takes it up to 2 rows
    std::printf("| per-block kernels, combine in the out projection | %.1f |\n",
                TimeOp(per_block(true)));
    std::printf("| per-block kernels, combine in the attention kernel (again) | %.1f |\n",
                TimeOp(per_block(false)));
  }
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
  at::Tensor ck = at::randn(PagedShape(batch, nkv, context, d), opt), cv = at::randn_like(ck);
  const at::Tensor table = RowPages(batch, context);
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
         vlmgraph::ops::RopeDecodeAttention(qkv, inv_freq, 1.0, pos, ck, cv, table, semaphores,
                                            context, nh);
       }},
      {"out: gemv + residual", true, [&](int i) { Linear(a, w_out[i % kCopies], x2); }},
      {"attention (partial states only) + out gemv combining them + residual", false,
       [&](int i) {
         if (batch > 4) return;  // AttentionCombineLinear takes up to 4 rows
         vlmgraph::ops::AttentionCombineLinear(
             vlmgraph::ops::RopeDecodeAttentionPartials(qkv, inv_freq, 1.0, pos, ck, cv, table,
                                                        semaphores, context, nh),
             w_out[i % kCopies], x2);
       }},
      {"gate_up: rms_norm + gemv", true,
       [&](int i) { vlmgraph::ops::RmsNormLinear(x2, w_norm, 1e-5, w_gu[i % kCopies]); }},
      {"down: silu_mul + gemv + residual", true,
       [&](int i) { vlmgraph::ops::SiluMulLinear(gu, w_down[i % kCopies], x2); }},
      {"lm head gemv (once per step)", false, [&](int) { Linear(x2, head); }},
      // One weight copy for every call, so the weights stay in L2: what is left is each kernel's
      // launch, dependency and reduction latency. (H100, batch 1: only 0.5-1.2 us below the rows
      // above, so prefetching the next layer's weights into L2 does not pay; measured in
      // docs/design/decode-kernels.md, "Prefetching weights".)
      {"weights in L2: qkv", false,
       [&](int) { vlmgraph::ops::RmsNormLinear(x2, w_norm, 1e-5, w_qkv[0]); }},
      {"weights in L2: out", false, [&](int) { Linear(a, w_out[0], x2); }},
      {"weights in L2: gate_up", false,
       [&](int) { vlmgraph::ops::RmsNormLinear(x2, w_norm, 1e-5, w_gu[0]); }},
      {"weights in L2: down", false, [&](int) { vlmgraph::ops::SiluMulLinear(gu, w_down[0], x2); }},
      {"unfused: rms_norm", false, [&](int) { vlmgraph::ops::RmsNorm(x2, w_norm, 1e-5); }},
      {"unfused: qkv cuBLAS", false, [&](int i) { at::linear(x2, w_qkv[i % kCopies]); }},
      {"unfused: rope + kv write", false,
       [&](int) {
         vlmgraph::ops::RopeKvWrite(qkv.view({batch, 1, -1}), inv_freq, 1.0, pos, {}, nh, nkv, ck,
                                    cv, table, false);
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
