#include "model/language_model.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <cmath>

#include "model/fused_ops.h"
#include "model/recompute.h"

namespace vlmgraph {

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : eps(eps) {
  weight = register_parameter("weight", at::ones({dim}));
}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  if (is_training() && ops::RmsNormDifferentiableSupported(x, weight))
    return ops::RmsNormDifferentiable(x, weight, eps);
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor irms = at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return (xf * irms).to(x.scalar_type()) * weight;
}

RotaryEmbeddingImpl::RotaryEmbeddingImpl(const VlmConfig& cfg)
    : attention_scaling(cfg.lm_attn_scaling) {
  const int64_t dim = cfg.lm_head_dim();
  at::Tensor exponent = at::arange(0, dim, 2, at::kFloat) / static_cast<double>(dim);
  inv_freq = register_buffer("inv_freq", 1.0 / at::pow(cfg.lm_re_base, exponent));
}

std::pair<at::Tensor, at::Tensor> RotaryEmbeddingImpl::forward(const at::Tensor& positions) {
  at::Tensor freqs = positions.to(at::kFloat).unsqueeze(-1) * inv_freq.to(at::kFloat);  // (B,T,D/2)
  at::Tensor emb = at::cat({freqs, freqs}, -1);                                         // (B,T,D)
  return {at::cos(emb) * attention_scaling, at::sin(emb) * attention_scaling};
}

namespace {
at::Tensor RotateHalf(const at::Tensor& x) {
  auto halves = x.chunk(2, -1);
  return at::cat({-halves[1], halves[0]}, -1);
}

// Writes keys/values (..., kv_heads, D) at pages / offsets (...) int64 of block `layer`
// (Note [Paged KV layout]): cache[page, :, offset, :] = value.
void WriteKv(KVCache& cache, int64_t layer, const at::Tensor& pages, const at::Tensor& offsets,
             const at::Tensor& k, const at::Tensor& v) {
  using at::indexing::Slice;
  at::Tensor& ck = cache.key[static_cast<size_t>(layer)];
  at::Tensor& cv = cache.value[static_cast<size_t>(layer)];
  ck.index_put_({pages, Slice(), offsets}, k.to(ck.scalar_type()));
  cv.index_put_({pages, Slice(), offsets}, v.to(cv.scalar_type()));
}

// The first `len` positions of each row of `table` (B, pages_per_row) int64 gathered from one
// block's paged keys or values (num_pages, kv_heads, page_size, D): (B, kv_heads, len, D).
at::Tensor GatherKv(const at::Tensor& paged, const at::Tensor& table, int64_t len) {
  const int64_t b = table.size(0), ps = paged.size(2);
  const int64_t pages = (len + ps - 1) / ps;
  at::Tensor rows = paged.index_select(0, table.narrow(1, 0, pages).reshape({-1}));
  return rows.view({b, pages, paged.size(1), ps, paged.size(3)})
      .permute({0, 2, 1, 3, 4})
      .reshape({b, paged.size(1), pages * ps, paged.size(3)})
      .narrow(2, 0, len);
}
}  // namespace

std::pair<at::Tensor, at::Tensor> ApplyRotary(const at::Tensor& q, const at::Tensor& k,
                                              const at::Tensor& cos, const at::Tensor& sin) {
  at::Tensor c = cos.unsqueeze(1).to(q.scalar_type());  // (B, 1, T, D)
  at::Tensor s = sin.unsqueeze(1).to(q.scalar_type());
  return {q * c + RotateHalf(q) * s, k * c + RotateHalf(k) * s};
}

GroupedQueryAttentionImpl::GroupedQueryAttentionImpl(const VlmConfig& cfg)
    : n_heads(cfg.lm_n_heads), n_kv_heads(cfg.lm_n_kv_heads), head_dim(cfg.lm_head_dim()) {
  auto lin = [](int64_t in, int64_t out) { return Dense(in, out, /*bias=*/false); };
  q_proj = register_module("q_proj", lin(cfg.lm_hidden_dim, n_heads * head_dim));
  k_proj = register_module("k_proj", lin(cfg.lm_hidden_dim, n_kv_heads * head_dim));
  v_proj = register_module("v_proj", lin(cfg.lm_hidden_dim, n_kv_heads * head_dim));
  out_proj = register_module("out_proj", lin(n_heads * head_dim, cfg.lm_hidden_dim));
}

at::Tensor GroupedQueryAttentionImpl::forward(const at::Tensor& x, const at::Tensor& cos,
                                              const at::Tensor& sin, const AttentionContext& ctx,
                                              int64_t layer) {
  const int64_t b = x.size(0), t = x.size(1), h = x.size(2);
  at::Tensor q = q_proj->forward(x).view({b, t, n_heads, head_dim});
  at::Tensor k = k_proj->forward(x).view({b, t, n_kv_heads, head_dim});
  at::Tensor v = v_proj->forward(x).view({b, t, n_kv_heads, head_dim}).transpose(1, 2);
  if (is_training() && ops::FusedKernelsAvailable(q)) {
    std::tie(q, k) = ops::RotaryDifferentiable(q, k, cos, sin);  // (B, T, heads, D)
    q = q.transpose(1, 2);
    k = k.transpose(1, 2);
  } else {
    std::tie(q, k) =
        ApplyRotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin);  // (B, heads, T, D)
  }

  at::Tensor y;
  if (ctx.mode == AttentionContext::Mode::kDecode) {
    // Write this step's key/value at each row's position, then attend over [0, kv_len) with the
    // per-row mask. GQA without materialising repeated heads: view q as (B, kv_heads, g, D).
    const int64_t ps = ctx.cache->page_size();
    at::Tensor table = ctx.cache->page_table.narrow(0, 0, b).to(at::kLong);  // (B, pages)
    at::Tensor page = table.gather(1, at::floor_divide(ctx.positions, ps).view({b, 1})).view({b});
    WriteKv(*ctx.cache, layer, page, ctx.positions.remainder(ps), k.select(2, 0), v.select(2, 0));
    at::Tensor keys = GatherKv(ctx.cache->key[layer], table, ctx.kv_len);      // (B, kvh, L, D)
    at::Tensor values = GatherKv(ctx.cache->value[layer], table, ctx.kv_len);  // (B, kvh, L, D)
    const int64_t groups = n_heads / n_kv_heads;
    at::Tensor qg = q.reshape({b, n_kv_heads, groups, head_dim});
    at::Tensor scores = at::matmul(qg, keys.transpose(-1, -2)) * (1.0 / std::sqrt(head_dim));
    scores =
        scores.masked_fill(ctx.key_mask.logical_not(), -std::numeric_limits<float>::infinity());
    at::Tensor probs = at::softmax(scores, -1, at::kFloat).to(values.scalar_type());
    y = at::matmul(probs, values).reshape({b, n_heads, 1, head_dim});  // (B, heads, 1, D)
  } else {
    if (ctx.mode == AttentionContext::Mode::kPrefill) {
      // Row slots[i]'s positions [0, t): page table[slots[i], p / page_size], offset p % size.
      const int64_t ps = ctx.cache->page_size();
      at::Tensor pos = at::arange(t, ctx.slots.options().dtype(at::kLong));
      at::Tensor table = ctx.cache->page_table.index_select(0, ctx.slots).to(at::kLong);
      at::Tensor page = table.index_select(1, at::floor_divide(pos, ps));  // (B, T)
      WriteKv(*ctx.cache, layer, page, pos.remainder(ps).expand({b, t}), k.transpose(1, 2),
              v.transpose(1, 2));
    }
    y = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                         /*is_causal=*/t > 1, /*scale=*/std::nullopt,
                                         /*enable_gqa=*/n_heads != n_kv_heads);
  }
  y = y.transpose(1, 2).contiguous().view({b, t, h});
  return out_proj->forward(y);
}

at::Tensor GroupedQueryAttentionImpl::ForwardFused(const at::Tensor& qkv,
                                                   const at::Tensor& inv_freq, double scaling,
                                                   const AttentionContext& ctx, int64_t layer) {
  const int64_t b = qkv.size(0), t = qkv.size(1);
  const bool cached = ctx.mode != AttentionContext::Mode::kNoCache;
  at::Tensor cache_k = cached ? ctx.cache->key[layer] : at::Tensor();
  at::Tensor cache_v = cached ? ctx.cache->value[layer] : at::Tensor();
  if (ctx.mode == AttentionContext::Mode::kDecode) {
    return ops::RopeDecodeAttention(qkv.view({b, qkv.size(2)}), inv_freq, scaling, ctx.positions,
                                    cache_k, cache_v, ctx.cache->page_table,
                                    ctx.cache->attention_semaphores, ctx.kv_len, n_heads)
        .view({b, 1, n_heads * head_dim});
  }
  ops::RopeKvOutput r = ops::RopeKvWrite(
      qkv, inv_freq, scaling, /*positions=*/{},
      ctx.mode == AttentionContext::Mode::kPrefill ? ctx.slots : at::Tensor(), n_heads, n_kv_heads,
      cache_k, cache_v, cached ? ctx.cache->page_table : at::Tensor(), /*want_k=*/true);
  at::Tensor v = qkv.narrow(2, (n_heads + n_kv_heads) * head_dim, n_kv_heads * head_dim)
                     .view({b, t, n_kv_heads, head_dim});
  at::Tensor y =
      at::scaled_dot_product_attention(r.q.transpose(1, 2), r.k.transpose(1, 2), v.transpose(1, 2),
                                       /*attn_mask=*/{}, 0.0, /*is_causal=*/t > 1, std::nullopt,
                                       /*enable_gqa=*/n_heads != n_kv_heads);
  return y.transpose(1, 2).reshape({b, t, n_heads * head_dim});
}

ops::DecodeAttentionPartials GroupedQueryAttentionImpl::DecodePartials(const at::Tensor& qkv,
                                                                       const at::Tensor& inv_freq,
                                                                       double scaling,
                                                                       const AttentionContext& ctx,
                                                                       int64_t layer) {
  TORCH_CHECK(ctx.mode == AttentionContext::Mode::kDecode, "DecodePartials is for decode steps");
  return ops::RopeDecodeAttentionPartials(
      qkv, inv_freq, scaling, ctx.positions, ctx.cache->key[layer], ctx.cache->value[layer],
      ctx.cache->page_table, ctx.cache->attention_semaphores, ctx.kv_len, n_heads);
}

SwiGluMlpImpl::SwiGluMlpImpl(const VlmConfig& cfg) {
  auto lin = [](int64_t in, int64_t out) { return Dense(in, out, /*bias=*/false); };
  gate_proj = register_module("gate_proj", lin(cfg.lm_hidden_dim, cfg.lm_inter_dim));
  up_proj = register_module("up_proj", lin(cfg.lm_hidden_dim, cfg.lm_inter_dim));
  down_proj = register_module("down_proj", lin(cfg.lm_inter_dim, cfg.lm_hidden_dim));
}

at::Tensor SwiGluMlpImpl::forward(const at::Tensor& x) {
  return down_proj->forward(at::silu(gate_proj->forward(x)) * up_proj->forward(x));
}

DecoderBlockImpl::DecoderBlockImpl(const VlmConfig& cfg) {
  mlp = register_module("mlp", SwiGluMlp(cfg));
  attn = register_module("attn", GroupedQueryAttention(cfg));
  norm1 = register_module("norm1", RMSNorm(cfg.lm_hidden_dim, cfg.lm_rms_eps));
  norm2 = register_module("norm2", RMSNorm(cfg.lm_hidden_dim, cfg.lm_rms_eps));
}

at::Tensor DecoderBlockImpl::forward(const at::Tensor& x, const at::Tensor& cos,
                                     const at::Tensor& sin, const AttentionContext& ctx,
                                     int64_t layer) {
  at::Tensor h = x + attn->forward(norm1->forward(x), cos, sin, ctx, layer);
  return h + mlp->forward(norm2->forward(h));
}

at::Tensor DecoderBlockImpl::ForwardFused(const at::Tensor& x, const at::Tensor& inv_freq,
                                          double scaling, const AttentionContext& ctx,
                                          int64_t layer, bool overwrite_x) {
  const int64_t b = x.size(0), t = x.size(1), hidden = x.size(2);
  at::Tensor x2 = x.reshape({b * t, hidden});
  // qkv = norm1(x) W_qkv^T; attention; h = x + out_proj(a); x' = h + down(silu_mul(norm2(h)
  // W_gu^T)).
  at::Tensor qkv = ops::RmsNormLinear(x2, norm1->weight, norm1->eps, attn->w_qkv);
  at::Tensor h;
  if (ctx.mode == AttentionContext::Mode::kDecode && ops::DecodeAttentionCombinesInLinear(b)) {
    // The out projection combines the attention's key splits itself (same values).
    h = ops::AttentionCombineLinear(attn->DecodePartials(qkv, inv_freq, scaling, ctx, layer),
                                    attn->out_proj->weight, x2);
  } else {
    at::Tensor a =
        attn->ForwardFused(qkv.view({b, t, qkv.size(-1)}), inv_freq, scaling, ctx, layer);
    h = ops::Linear(a.reshape({b * t, hidden}), attn->out_proj->weight, x2, overwrite_x);
  }
  at::Tensor gu = ops::RmsNormLinear(h, norm2->weight, norm2->eps, mlp->w_gate_up);
  return ops::SiluMulLinear(gu, mlp->down_proj->weight, h, /*add_into_residual=*/true)
      .view({b, t, hidden});
}

LanguageModelImpl::LanguageModelImpl(const VlmConfig& config) : cfg(config) {
  // Upstream LanguageModel._init_weights: Linear and Embedding ~ N(0, 0.02) (Dense and
  // EmbeddingTable start so); RMSNorm weight 1.
  token_embedding =
      register_module("token_embedding", EmbeddingTable(cfg.lm_vocab_size, cfg.lm_hidden_dim));
  rotary_embd = register_module("rotary_embd", RotaryEmbedding(cfg));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < cfg.lm_n_blocks; ++i) blocks->push_back(DecoderBlock(cfg));
  norm = register_module("norm", RMSNorm(cfg.lm_hidden_dim, cfg.lm_rms_eps));
  if (!cfg.lm_tie_weights) {
    head = register_module("head", Dense(cfg.lm_hidden_dim, cfg.lm_vocab_size, /*bias=*/false));
  }
}

at::Tensor LanguageModelImpl::Run(const at::Tensor& x, const at::Tensor& positions,
                                  const AttentionContext& ctx, const BlockHook& before_block) {
  auto hook = [&](size_t i) {
    if (before_block) before_block(static_cast<int64_t>(i));
  };
  if (UsesFusedPath(x)) {
    at::Tensor h = x.contiguous();
    // The blocks may add into the residual stream in place once it is this forward's own (from
    // the first block's output on, or a contiguous copy of x): copying x just for that cost more
    // at batch 1 (a kernel in the chain, ~3 us per step) than the one in-place add saves.
    bool owned = !h.is_same(x);
    for (size_t i = 0; i < blocks->size(); ++i) {
      hook(i);
      h = blocks[i]->as<DecoderBlock>()->ForwardFused(h, rotary_embd->inv_freq,
                                                      rotary_embd->attention_scaling, ctx,
                                                      static_cast<int64_t>(i), owned);
      owned = true;
    }
    hook(blocks->size());
    return ops::RmsNorm(h, norm->weight, norm->eps);
  }
  auto [cos, sin] = rotary_embd->forward(positions);
  at::Tensor h = x;
  for (size_t i = 0; i < blocks->size(); ++i) {
    auto block = std::dynamic_pointer_cast<DecoderBlockImpl>(blocks[i]);
    const int64_t layer = static_cast<int64_t>(i);
    hook(i);
    if (recompute_blocks && ctx.mode == AttentionContext::Mode::kNoCache) {
      h = Recompute([block, cos = cos, sin = sin, ctx, layer](
                        const at::Tensor& in) { return block->forward(in, cos, sin, ctx, layer); },
                    h);
    } else {
      h = block->forward(h, cos, sin, ctx, layer);
    }
  }
  hook(blocks->size());
  return norm->forward(h);
}

at::Tensor LanguageModelImpl::Forward(const at::Tensor& x, const BlockHook& before_block) {
  RECORD_USER_SCOPE("vlmgraph::decoder");
  const int64_t b = x.size(0), t = x.size(1);
  at::Tensor positions = at::arange(t, x.options().dtype(at::kLong)).unsqueeze(0).expand({b, t});
  return Run(x, positions, AttentionContext{}, before_block);
}

at::Tensor LanguageModelImpl::Prefill(const at::Tensor& x, KVCache* cache,
                                      const at::Tensor& slots) {
  TORCH_CHECK(cache != nullptr, "Prefill needs a KV cache");
  const int64_t b = x.size(0), t = x.size(1);
  TORCH_CHECK(t <= cache->max_seq_len(), "prefill of ", t, " tokens exceeds the KV cache length ",
              cache->max_seq_len());
  AttentionContext ctx;
  ctx.mode = AttentionContext::Mode::kPrefill;
  ctx.cache = cache;
  ctx.slots = slots;
  at::Tensor positions = at::arange(t, x.options().dtype(at::kLong)).unsqueeze(0).expand({b, t});
  return Run(x, positions, ctx);
}

at::Tensor LanguageModelImpl::Decode(const at::Tensor& x, KVCache* cache,
                                     const at::Tensor& positions, int64_t kv_len) {
  TORCH_CHECK(cache != nullptr, "Decode needs a KV cache");
  const int64_t b = x.size(0);
  TORCH_CHECK(x.size(1) == 1, "Decode takes one token per row, got ", x.size(1));
  TORCH_CHECK(b <= cache->rows(), "decode batch ", b, " exceeds the KV cache's ", cache->rows(),
              " rows");
  TORCH_CHECK(kv_len > 0 && kv_len <= cache->max_seq_len(), "kv_len ", kv_len, " outside (0, ",
              cache->max_seq_len(), "]");
  AttentionContext ctx;
  ctx.mode = AttentionContext::Mode::kDecode;
  ctx.cache = cache;
  ctx.positions = positions;
  ctx.kv_len = kv_len;
  if (!UsesFusedPath(x)) {  // the fused attention kernel masks by position itself
    at::Tensor key_index = at::arange(kv_len, positions.options());
    ctx.key_mask = key_index.unsqueeze(0).le(positions.unsqueeze(1)).view({b, 1, 1, kv_len});
  }
  return Run(x, positions.view({b, 1}), ctx);
}

at::Tensor LanguageModelImpl::HeadWeight() const {
  return cfg.lm_tie_weights ? token_embedding->weight : head->weight;
}

void LanguageModelImpl::FuseWeights() {
  torch::NoGradGuard no_grad;
  for (const auto& m : *blocks) {
    auto* block = m->as<DecoderBlock>();
    auto* attn = block->attn.get();
    auto* mlp = block->mlp.get();
    if (attn->w_qkv.defined() && attn->q_proj->weight.data_ptr() == attn->w_qkv.data_ptr())
      continue;
    attn->w_qkv = at::cat({attn->q_proj->weight, attn->k_proj->weight, attn->v_proj->weight}, 0);
    const int64_t q_rows = attn->q_proj->weight.size(0), kv_rows = attn->k_proj->weight.size(0);
    attn->q_proj->weight.set_data(attn->w_qkv.narrow(0, 0, q_rows));
    attn->k_proj->weight.set_data(attn->w_qkv.narrow(0, q_rows, kv_rows));
    attn->v_proj->weight.set_data(attn->w_qkv.narrow(0, q_rows + kv_rows, kv_rows));
    mlp->w_gate_up = at::cat({mlp->gate_proj->weight, mlp->up_proj->weight}, 0);
    const int64_t inter = mlp->gate_proj->weight.size(0);
    mlp->gate_proj->weight.set_data(mlp->w_gate_up.narrow(0, 0, inter));
    mlp->up_proj->weight.set_data(mlp->w_gate_up.narrow(0, inter, inter));
  }
}

bool LanguageModelImpl::UsesFusedPath(const at::Tensor& x) const {
  if (at::GradMode::is_enabled() || !ops::FusedKernelsAvailable(x) || blocks->size() == 0)
    return false;
  if (!ops::FusedDecoderSupports(cfg.lm_head_dim(), cfg.lm_n_heads / cfg.lm_n_kv_heads))
    return false;
  const auto* attn = (*blocks)[0]->as<DecoderBlock>()->attn.get();
  // Fused only while the parameters still alias the stacked weights (a later .to() breaks that).
  return attn->w_qkv.defined() && attn->q_proj->weight.data_ptr() == attn->w_qkv.data_ptr() &&
         attn->w_qkv.device() == x.device() && attn->w_qkv.scalar_type() == x.scalar_type();
}

at::Tensor LanguageModelImpl::CrossEntropySum(const at::Tensor& hidden, const at::Tensor& targets,
                                              int64_t ignore_index) {
  RECORD_USER_SCOPE("vlmgraph::lm_head_loss");
  at::Tensor rows = hidden.reshape({-1, hidden.size(-1)});
  at::Tensor head = HeadWeight();
  if (ops::LinearCrossEntropySupported(rows, head))
    return ops::LinearCrossEntropy(rows, head, targets.reshape({-1}), ignore_index);
  return at::cross_entropy_loss(Logits(rows).to(at::kFloat), targets.reshape({-1}), {},
                                at::Reduction::Sum, ignore_index);
}

at::Tensor LanguageModelImpl::Logits(const at::Tensor& hidden) {
  if (UsesFusedPath(hidden)) return ops::Linear(hidden.contiguous(), HeadWeight());
  return at::linear(hidden, HeadWeight());
}

}  // namespace vlmgraph
