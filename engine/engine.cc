#include "engine/engine.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <numeric>
#include <sstream>

#include "base/log.h"
#include "engine/bucket_sizing.h"
#include "engine/device.h"
#include "engine/engine_internal.h"
#include "engine/sampler.h"
#include "image/image_processor.h"
#include "model/fused_ops.h"
#include "model/prompt_check.h"

namespace vlmgraph {
namespace {
using engine_internal::DecodeInputBytes;
using engine_internal::DecodeInputs;
using engine_internal::DecodeInputViews;

std::string CounterKey(const BucketKey& k) {
  return std::string(RegionName(k.region)) + "/" + k.Label();
}

}  // namespace

Engine::Engine(VisionLanguageModel model, EngineOptions options)
    : model_(std::move(model)), options_(std::move(options)) {
  ops::SetProgrammaticDependentLaunch(options_.programmatic_dependent_launch);
  try {
    options_.buckets.Validate();
  } catch (const std::invalid_argument& e) {
    throw EngineError::InvalidArgument(e.what());
  }
  const VlmConfig& cfg = model_->cfg;
  if (options_.dtype != at::kFloat && options_.dtype != at::kBFloat16) {
    throw EngineError::InvalidArgument("dtype must be float32 or bfloat16");
  }
  if (options_.max_tiles_per_request <= 0) options_.max_tiles_per_request = MaxTilesPerImage(cfg);
  const auto& b = options_.buckets;
  if (b.max_context() > cfg.lm_max_position_embeddings) {
    throw EngineError::InvalidArgument("buckets.context_lens max (" +
                                       std::to_string(b.max_context()) +
                                       ") exceeds the model's lm_max_position_embeddings (" +
                                       std::to_string(cfg.lm_max_position_embeddings) + ")");
  }
  model_->to(options_.device, options_.dtype);
  // RoPE frequencies stay float32 whatever the weights' dtype.
  model_->decoder->rotary_embd->inv_freq.set_data(
      model_->decoder->rotary_embd->inv_freq.to(at::kFloat));
  model_->eval();
  for (auto& p : model_->parameters()) p.set_requires_grad(false);
  // Stacked q/k/v and gate/up weights: the fused CUDA decoder path (no-op for CPU inference).
  model_->decoder->FuseWeights();
  if (b.batch_sizes.empty()) DeriveBatchSizes();

  const bool cuda = options_.device.is_cuda();
  if (cuda && options_.cuda_graphs) {
    runner_ = MakeCudaGraphStepRunner(options_.device.has_index() ? options_.device.index() : 0);
  }
  if (!runner_) runner_ = std::make_unique<EagerStepRunner>();
  if (options_.check_graphs) {
    runner_->set_check_static_inputs(*options_.check_graphs);
    runner_->set_check_output_lifetime(*options_.check_graphs);
  }
  // What every graph reads in place (Note [Static input check], engine/step_runner.h).
  runner_->WatchStaticInputs([this] {
    std::vector<at::Tensor> inputs = model_->parameters();
    for (const at::Tensor& t : model_->buffers()) inputs.push_back(t);
    const Buffers& bf = *buffers_;
    for (const at::Tensor& t :
         {bf.ids, bf.slots, bf.last, bf.tiles, bf.image_rows, bf.dec_in, bf.dec_carry}) {
      inputs.push_back(t);
    }
    inputs.insert(inputs.end(), bf.cache.key.begin(), bf.cache.key.end());
    inputs.insert(inputs.end(), bf.cache.value.begin(), bf.cache.value.end());
    inputs.push_back(bf.cache.page_table);
    return inputs;
  });
  dispatch_ = std::make_unique<RegionDispatcher>(
      runner_.get(), [this](const BucketKey& exact, const std::string& reason) {
        CountEagerFallback(exact, reason);
      });

  auto i64 = at::TensorOptions().dtype(at::kLong).device(options_.device);
  auto act = at::TensorOptions().dtype(options_.dtype).device(options_.device);
  buffers_ = std::make_unique<Buffers>();
  Buffers& buf = *buffers_;
  // Prefill staging holds the largest prefill bucket; decode inputs and KV rows every slot.
  buf.ids = at::zeros({b.max_prefill() * b.max_seq()}, i64);
  buf.scratch_row = b.max_batch();
  buf.slots = at::full({b.max_prefill()}, buf.scratch_row, i64);
  buf.last = at::zeros({b.max_prefill()}, i64);
  buf.tiles = at::zeros({b.max_tiles(), 3, cfg.vit_img_size, cfg.vit_img_size}, act);
  buf.image_rows = at::zeros({b.max_prefill() * b.max_seq(), cfg.lm_hidden_dim}, act);
  buf.dec_in = at::zeros({DecodeInputBytes(b.max_batch())}, i64.dtype(at::kByte));
  const DecodeInputs dec = DecodeInputViews(buf.dec_in, b.max_batch());
  buf.dec_tokens = dec.tokens;
  buf.dec_pos = dec.positions;
  buf.dec_carry_flag = dec.carry;
  buf.dec_carry = at::zeros({b.max_batch()}, i64);
  auto pinned = at::TensorOptions().pinned_memory(cuda);
  buf.host_dec_in = at::zeros({2, DecodeInputBytes(b.max_batch())}, pinned.dtype(at::kByte));
  buf.host_dec_tokens = at::zeros({2, b.max_batch()}, pinned.dtype(at::kLong));
  for (auto& e : buf.dec_done) e = std::make_unique<DeviceEvent>(options_.device);
  overlap_decode_ = options_.overlap_decode_steps.value_or(cuda);
  // Derived: the pages memory holds; given batch sizes: every slot's longest context (Note [KV
  // pages per sequence]).
  const int64_t per_sequence = vlmgraph::KvPagesFor(b.max_context(), kDefaultKvPageSize);
  if (options_.kv_cache_pages > 0 && options_.kv_cache_pages < per_sequence) {
    throw EngineError::InvalidArgument("kv_cache_pages " + std::to_string(options_.kv_cache_pages) +
                                       " does not hold one sequence of the longest context (" +
                                       std::to_string(per_sequence) + " pages of " +
                                       std::to_string(kDefaultKvPageSize) + " tokens)");
  }
  const int64_t pages = options_.kv_cache_pages > 0 ? options_.kv_cache_pages + 1
                        : derived_kv_pages_ > 0     ? derived_kv_pages_
                                                    : b.max_batch() * per_sequence + 1;
  buf.cache = KVCache::AllocatePaged(cfg, b.max_batch() + 1, b.max_context(), pages, act);
  kv_pages_ = KvPagePool(pages);
  slots_.resize(static_cast<size_t>(b.max_batch()));
}

void Engine::DeriveBatchSizes() {
  BucketSpec& b = options_.buckets;
  if (!options_.device.is_cuda()) {
    throw EngineError::InvalidArgument(
        "buckets.batch_sizes is empty: it is derived from device memory on CUDA devices only; "
        "give the list on " +
        options_.device.str());
  }
  // What the weights (and the CUDA context, and other processes) hold, without the blocks the
  // caching allocator keeps from loading.
  ReleaseCachedMemory(options_.device);
  const DeviceCapacity capacity = DeviceMemoryCapacity(options_.device);
  const int64_t dtype_bytes = options_.dtype == at::kBFloat16 ? 2 : 4;
  DecodeSizing sizing;
  try {
    sizing = SizeDecodeBatches(model_->cfg, b, dtype_bytes,
                               DeviceBudget{capacity.total_bytes, capacity.free_bytes});
  } catch (const std::invalid_argument& e) {
    throw EngineError(EngineError::Code::kResourceExhausted, e.what());
  }
  b.batch_sizes = sizing.batch_sizes;
  try {
    b.Validate();
  } catch (const std::invalid_argument& e) {
    throw EngineError::InvalidArgument(e.what());
  }
  derived_graph_pool_estimate_bytes_ = sizing.graph_pool_bytes;
  derived_kv_pages_ = sizing.kv_pages;
  LogInfo(sizing.Summary(b.gpu_memory_utilization, b.max_decode_batch));
}

Engine::~Engine() {
  // A queued decode step may still run on the device; let it finish before its buffers and
  // graphs go.
  try {
    SynchronizeDevice(options_.device);
  } catch (...) {
  }
}

bool Engine::graphs_enabled() const { return runner_->captures(); }

// ---------------------------------------------------------------------------------------------
// Region functions. Each reads only the static buffers (prefix views with fixed addresses) and
// returns its outputs, so the same function runs eagerly or is captured into a graph.

RegionFn Engine::MakeRegionFn(const BucketKey& key) {
  Buffers* bf = buffers_.get();
  VisionLanguageModelImpl* m = model_.get();
  const int64_t hidden = m->cfg.lm_hidden_dim;
  switch (key.region) {
    case Region::kVision: {
      const int64_t t = key.tiles;
      return [m, bf, t] {
        return std::vector<at::Tensor>{m->EncodeImages(bf->tiles.narrow(0, 0, t))};
      };
    }
    case Region::kPrefill: {
      const int64_t b = key.batch, s = key.seq;
      return [m, bf, b, s, hidden] {
        at::Tensor ids = bf->ids.narrow(0, 0, b * s).view({b, s});
        at::Tensor h = m->decoder->Prefill(m->Embed(ids, bf->image_rows), &bf->cache,
                                           bf->slots.narrow(0, 0, b));
        at::Tensor idx = bf->last.narrow(0, 0, b).view({b, 1, 1}).expand({b, 1, hidden});
        at::Tensor logits = m->decoder->Logits(h.gather(1, idx).squeeze(1));  // (b, V)
        return std::vector<at::Tensor>{logits, h};                            // h: (b, s, H)
      };
    }
    case Region::kDecode: {
      const int64_t b = key.batch, c = key.seq;
      return [m, bf, b, c] {
        // A carried row's token is the previous step's output, already on the device.
        at::Tensor tokens =
            at::where(bf->dec_carry_flag.narrow(0, 0, b), bf->dec_carry.narrow(0, 0, b),
                      bf->dec_tokens.narrow(0, 0, b));
        at::Tensor x = m->decoder->token_embedding->forward(tokens.view({b, 1}));
        at::Tensor h = m->decoder->Decode(x, &bf->cache, bf->dec_pos.narrow(0, 0, b), c);
        at::Tensor logits = m->decoder->Logits(h.select(1, 0));  // (b, V)
        // Greedy tokens (b) int64 inside the region, so a step launches nothing after it, and
        // into dec_carry (read above, so in stream order after that read), where the next step
        // carries them from: a region's outputs are valid only until the runner's next run of
        // any bucket (Note [Graph memory pool]), and a prefill runs between two decode steps.
        ops::ArgmaxRowsInto(logits, bf->dec_carry.narrow(0, 0, b));
        return std::vector<at::Tensor>{logits};
      };
    }
    case Region::kTrain:
      break;
  }
  throw EngineError(EngineError::Code::kInternal, "no inference region function for train buckets");
}

DispatchResult Engine::Dispatch(const std::optional<BucketKey>& bucket, const BucketKey& exact,
                                const RegionDispatcher::BucketedFn& bucketed,
                                const RegionFn& exact_fn, int64_t real_tokens) {
  DispatchResult r = dispatch_->Run(bucket, exact, bucketed, exact_fn);
  const auto t_sync = Clock::now();
  SynchronizeDevice(options_.device);
  if (r.kind == RunKind::kCaptureAndReplay) graph_pool_bytes_ = runner_->pool_bytes();
  int64_t padded = real_tokens;
  if (r.bucketed) padded = r.key.region == Region::kVision ? r.key.tiles : r.key.batch * r.key.seq;
  Count(r.key, r.kind, r.seconds + SecondsSince(t_sync), real_tokens, padded, r.bucketed);
  return r;
}

void Engine::CountEagerFallback(const BucketKey& exact, const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(counters_mu_);
    counters_.eager_fallbacks++;
  }
  if (observer_) observer_->OnEagerFallback(exact.region, reason);
}

void Engine::Count(const BucketKey& key, RunKind kind, double seconds, int64_t real, int64_t padded,
                   bool bucketed) {
  CountRun(key, kind, real, padded, bucketed);
  ObserveTime(key, kind, seconds);
}

void Engine::CountRun(const BucketKey& key, RunKind kind, int64_t real, int64_t padded,
                      bool bucketed) {
  // Exact shapes share one key per region, so the counters stay bounded whatever lengths come.
  const std::string k = bucketed ? CounterKey(key) : std::string(RegionName(key.region)) + "/exact";
  {
    std::lock_guard<std::mutex> lock(counters_mu_);
    if (kind == RunKind::kEager) {
      counters_.eager_runs[k]++;
    } else {
      counters_.replays[k]++;
      if (kind == RunKind::kCaptureAndReplay) counters_.captures[k]++;
    }
    counters_.real_tokens += real;
    counters_.padded_tokens += padded;
  }
  if (observer_) observer_->OnTokens(key.region, real, padded);
}

void Engine::ObserveTime(const BucketKey& key, RunKind kind, double seconds) {
  if (!observer_) return;
  if (kind == RunKind::kCaptureAndReplay) observer_->OnCapture(key, seconds);
  observer_->OnStep(key, kind != RunKind::kEager, seconds);
}

void Engine::Warmup() {
  if (warmed_up_) return;
  warmed_up_ = true;
  if (!runner_->captures() || options_.lazy_capture) return;
  at::NoGradGuard no_grad;
  const auto t0 = Clock::now();
  const auto& cfg = model_->cfg;
  std::vector<BucketKey> keys;
  for (Region r : {Region::kPrefill, Region::kDecode, Region::kVision}) {
    for (const auto& k : options_.buckets.All(r)) keys.push_back(k);
  }
  // Largest activations first across regions, so later captures reuse the pool's blocks.
  auto activation = [&](const BucketKey& k) {
    if (k.region == Region::kVision) return k.tiles * cfg.vit_num_patches() * cfg.vit_inter_dim;
    return k.batch * (k.region == Region::kDecode ? 1 : k.seq) * cfg.lm_inter_dim;
  };
  std::stable_sort(keys.begin(), keys.end(), [&](const BucketKey& x, const BucketKey& y) {
    return activation(x) > activation(y);
  });
  int64_t pool_before = runner_->pool_bytes();
  for (const auto& key : keys) {
    const double seconds = runner_->Capture(key, MakeRegionFn(key));
    const int64_t pool_after = runner_->pool_bytes();
    {
      std::lock_guard<std::mutex> lock(counters_mu_);
      counters_.captures[CounterKey(key)]++;
      counters_.capture_seconds_total += seconds;
      counters_.capture_seconds[CounterKey(key)] = seconds;
      counters_.capture_pool_growth_bytes[CounterKey(key)] = pool_after - pool_before;
    }
    pool_before = pool_after;
    if (observer_) observer_->OnCapture(key, seconds);
    if (options_.log_captures) {
      LogDebug(LogFormat("captured %-7s %-10s in %7.1f ms", RegionName(key.region),
                         key.Label().c_str(), seconds * 1e3));
    }
  }
  SynchronizeDevice(options_.device);
  graph_pool_bytes_ = runner_->pool_bytes();
  if (options_.log_captures) {
    LogInfo(
        LogFormat("capture summary: %zu graphs in %.2f s, graph pool %.1f MiB, KV cache %.1f MiB",
                  keys.size(), SecondsSince(t0), graph_pool_bytes_.load() / 1048576.0,
                  buffers_->cache.bytes() / 1048576.0) +
        (derived_graph_pool_estimate_bytes_ > 0
             ? LogFormat(" (graph pool estimated %.1f MiB when batch_sizes was derived)",
                         derived_graph_pool_estimate_bytes_ / 1048576.0)
             : std::string()));
  }
}

// ---------------------------------------------------------------------------------------------
// Vision and prefill.

at::Tensor Engine::ToDevice(const at::Tensor& tiles) const {
  // Copy first, convert on the device: a CPU-to-GPU copy that changes dtype converts on the CPU,
  // which for a 512x512 tile costs milliseconds of the request's time to first token. From pinned
  // memory the copy is queued without waiting (the caching host allocator keeps the block until
  // it has run).
  return tiles.to(options_.device, /*non_blocking=*/tiles.is_pinned()).to(options_.dtype);
}

void Engine::RunVision(const at::Tensor& tiles, int64_t row_offset) {
  Buffers& buf = *buffers_;
  VisionLanguageModelImpl* m = model_.get();
  const int64_t tokens = model_->cfg.mp_image_token_length;
  const int64_t max_tiles = options_.buckets.max_tiles();
  for (int64_t start = 0; start < tiles.size(0); start += max_tiles) {
    const int64_t n = std::min<int64_t>(max_tiles, tiles.size(0) - start);
    const at::Tensor chunk = tiles.narrow(0, start, n);
    const DispatchResult r = Dispatch(
        options_.buckets.PickVision(n), BucketKey{Region::kVision, 0, 0, n},
        [&](const BucketKey& key) {
          buf.tiles.narrow(0, 0, n).copy_(chunk, /*non_blocking=*/true);
          return MakeRegionFn(key);
        },
        [&] { return std::vector<at::Tensor>{m->EncodeImages(chunk)}; }, n);
    at::Tensor rows = r.outputs[0];  // (bucket or exact tiles * tokens, H)
    buf.image_rows.narrow(0, row_offset + start * tokens, n * tokens)
        .copy_(rows.narrow(0, 0, n * tokens));
  }
}

DispatchResult Engine::Prefill(const std::vector<const GenerateRequest*>& requests,
                               const std::vector<int64_t>& slots, const RegionFn& exact_fn) {
  const int64_t n = static_cast<int64_t>(requests.size());
  int64_t max_len = 0, real = 0;
  for (const auto* r : requests) {
    max_len = std::max<int64_t>(max_len, r->input_ids.size());
    real += r->input_ids.size();
  }
  DispatchResult r = Dispatch(
      options_.buckets.PickPrefill(n, max_len), BucketKey{Region::kPrefill, n, max_len, 0},
      [&](const BucketKey& key) {
        FillPrefill(requests, slots, key);
        return MakeRegionFn(key);
      },
      exact_fn, real);
  r.outputs[0] = r.outputs[0].narrow(0, 0, n);
  return r;
}

void Engine::FillPrefill(const std::vector<const GenerateRequest*>& requests,
                         const std::vector<int64_t>& slots, const BucketKey& key) {
  Buffers& buf = *buffers_;
  const int64_t n = static_cast<int64_t>(requests.size());
  std::vector<at::Tensor> tiles;
  for (const auto* r : requests) {
    if (r->tiles.defined() && r->tiles.numel() > 0) tiles.push_back(r->tiles);
  }
  if (!tiles.empty()) {
    // Each request's tiles go to the device as they are and are joined there: joining them on the
    // host first would copy every tile once more in host memory (for a 512x512 tile 3 MB, 0.3 to
    // 2 ms depending on the host).
    for (at::Tensor& t : tiles) t = ToDevice(t);
    RunVision(tiles.size() == 1 ? tiles[0] : at::cat(tiles, 0), 0);
  }
  // Host-side padding: rows right-padded with the pad id; padding rows write the scratch KV row.
  // Causal attention means real tokens never see the right padding, so their logits equal an
  // unpadded run's.
  at::Tensor ids = at::full({key.batch, key.seq}, model_->cfg.pad_token_id(), at::kLong);
  at::Tensor slot_ids = at::full({key.batch}, buf.scratch_row, at::kLong);
  at::Tensor last = at::zeros({key.batch}, at::kLong);
  int64_t* ids_p = ids.data_ptr<int64_t>();
  int64_t* slot_p = slot_ids.data_ptr<int64_t>();
  int64_t* last_p = last.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const auto& p = requests[i]->input_ids;
    std::copy(p.begin(), p.end(), ids_p + i * key.seq);
    slot_p[i] = slots[i];
    last_p[i] = static_cast<int64_t>(p.size()) - 1;
  }
  buf.ids.narrow(0, 0, key.batch * key.seq).copy_(ids.view({-1}), /*non_blocking=*/true);
  buf.slots.narrow(0, 0, key.batch).copy_(slot_ids, true);
  buf.last.narrow(0, 0, key.batch).copy_(last, true);
  if (observer_) observer_->OnBatch(Region::kPrefill, n);
}

Engine::ExactPrompts Engine::ToExactPrompts(
    const std::vector<const GenerateRequest*>& requests) const {
  const int64_t n = static_cast<int64_t>(requests.size());
  int64_t max_len = 0;
  for (const auto* r : requests) max_len = std::max<int64_t>(max_len, r->input_ids.size());
  ExactPrompts p;
  at::Tensor ids = at::full({n, max_len}, model_->cfg.pad_token_id(), at::kLong);
  at::Tensor last = at::zeros({n}, at::kLong);
  std::vector<at::Tensor> tiles;
  for (int64_t i = 0; i < n; ++i) {
    const auto& q = requests[i]->input_ids;
    std::copy(q.begin(), q.end(), ids.data_ptr<int64_t>() + i * max_len);
    last.data_ptr<int64_t>()[i] = static_cast<int64_t>(q.size()) - 1;
    if (requests[i]->tiles.defined() && requests[i]->tiles.numel() > 0)
      tiles.push_back(ToDevice(requests[i]->tiles));
  }
  p.ids = ids.to(options_.device);
  p.last = last.to(options_.device);
  if (!tiles.empty()) p.tiles = tiles.size() == 1 ? tiles[0] : at::cat(tiles, 0);
  return p;
}

std::vector<at::Tensor> Engine::PrefillExact(const ExactPrompts& p, const at::Tensor& slots,
                                             bool write_cache) {
  VisionLanguageModelImpl* m = model_.get();
  at::Tensor rows = p.tiles.defined() ? m->EncodeImages(p.tiles) : at::Tensor();
  at::Tensor x = m->Embed(p.ids, rows);
  at::Tensor h = write_cache ? m->decoder->Prefill(x, &buffers_->cache, slots)
                             : m->decoder->Forward(x);  // (n, len, H)
  const int64_t hidden = h.size(2);
  at::Tensor idx = p.last.view({-1, 1, 1}).expand({p.last.size(0), 1, hidden});
  return {m->decoder->Logits(h.gather(1, idx).squeeze(1)), h};
}

std::vector<int64_t> Engine::SampleRows(const at::Tensor& logits,
                                        const std::vector<Sequence*>& seqs) {
  at::Tensor tokens = ops::ArgmaxRows(logits);  // greedy for every row; sampled rows overwritten
  std::vector<SamplingDraw> draws;
  for (size_t i = 0; i < seqs.size(); ++i) {
    if (!seqs[i]->sampling.greedy) {
      draws.push_back({static_cast<int64_t>(i), &seqs[i]->sampling, seqs[i]->generated});
    }
  }
  SampleRowsInto(logits, draws, tokens);
  at::Tensor host = tokens.to(at::kCPU);  // the step's one synchronising copy
  return std::vector<int64_t>(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel());
}

// ---------------------------------------------------------------------------------------------
// Scoring.

ForwardResult Engine::Forward(const ValidatedForward& validated) {
  const ForwardRequest& request = validated.request_;
  const int64_t len = static_cast<int64_t>(request.input_ids.size());
  at::NoGradGuard no_grad;
  ForwardResult result;
  const GenerateRequest as_prompt{request.input_ids, request.tiles, {}};
  const std::vector<const GenerateRequest*> one{&as_prompt};
  // A bucket runs on the scratch KV row, so scoring never disturbs a live sequence's cache; a
  // prompt longer than every seq bucket runs at its exact length without the cache.
  const DispatchResult r = Prefill(one, {buffers_->scratch_row}, [&] {
    return PrefillExact(ToExactPrompts(one), at::Tensor(), /*write_cache=*/false);
  });
  result.bucket = r.key;
  result.graphed = r.kind != RunKind::kEager;
  const at::Tensor hidden = r.outputs[1].select(0, 0).narrow(0, 0, len);  // (len, H)
  at::Tensor logits = model_->decoder->Logits(hidden).to(at::kFloat);     // (len, V)
  if (!request.target_ids.empty()) {
    at::Tensor targets = at::tensor(request.target_ids, at::kLong).to(options_.device);
    result.loss_tokens = targets.ne(-100).sum().item<int64_t>();
    result.loss = result.loss_tokens > 0
                      ? VisionLanguageModelImpl::Loss(logits.unsqueeze(0), targets.unsqueeze(0))
                            .item<double>()
                      : 0.0;
  }
  if (!request.logits_positions.empty()) {
    at::Tensor idx = at::tensor(request.logits_positions, at::kLong).to(options_.device);
    at::Tensor rows = logits.index_select(0, idx).to(at::kCPU).contiguous();
    for (int64_t i = 0; i < rows.size(0); ++i) {
      const float* p = rows[i].data_ptr<float>();
      result.logits.emplace_back(p, p + rows.size(1));
    }
  }
  return result;
}

double Engine::TimeRegion(const BucketKey& key, int iters) {
  at::NoGradGuard no_grad;
  const bool idle_decode = key.region == Region::kDecode && ActiveSequences() == 0;
  KVCache& cache = buffers_->cache;
  if (idle_decode) {
    // Representative attention length: every row at the end of the bucket's context, on pages
    // of its own (as many distinct pages as the cache has), not all on the scratch page.
    buffers_->dec_pos.narrow(0, 0, key.batch).fill_(key.seq - 1);
    const int64_t per_row = vlmgraph::KvPagesFor(key.seq, cache.page_size());
    at::Tensor pages =
        at::arange(key.batch * per_row, at::kInt).remainder(cache.num_pages() - 1) + 1;
    cache.page_table.narrow(0, 0, key.batch)
        .narrow(1, 0, per_row)
        .copy_(pages.view({key.batch, per_row}).to(options_.device));
  }
  // A decode region leaves its tokens in dec_carry for the next step: keep the queued step's.
  const at::Tensor carried =
      key.region == Region::kDecode ? buffers_->dec_carry.clone() : at::Tensor();
  RegionFn fn = MakeRegionFn(key);
  std::vector<at::Tensor> outputs;
  runner_->Run(key, fn, runner_->captures(), &outputs);
  SynchronizeDevice(options_.device);
  const auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) runner_->Run(key, fn, false, &outputs);
  SynchronizeDevice(options_.device);
  const double seconds = SecondsSince(t0) / std::max(1, iters);
  if (carried.defined()) buffers_->dec_carry.copy_(carried);
  if (idle_decode) cache.page_table.zero_();  // every slot is free
  return seconds;
}

// ---------------------------------------------------------------------------------------------
// Observation.

EngineCounters Engine::Counters() const {
  std::lock_guard<std::mutex> lock(counters_mu_);
  return counters_;
}

MemoryStats Engine::Memory() const {
  MemoryStats m = DeviceMemory(options_.device);
  m.graph_pool_bytes = graph_pool_bytes_.load();
  m.kv_cache_bytes = buffers_->cache.bytes();
  m.kv_cache_pages = buffers_->cache.num_pages() - 1;
  m.kv_cache_pages_used = kv_pages_used_.load();
  m.kv_cache_page_size = buffers_->cache.page_size();
  return m;
}

void Engine::SetObserver(EngineObserver* observer) { observer_ = observer; }

}  // namespace vlmgraph
