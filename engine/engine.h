// engine/engine.h: bucketed, graph-replayed inference for a nanoVLM model.
//
// The engine owns the model on its device, a paged KV cache (model/kv_cache.h) with a page-table
// row per decode slot (its pages and slots as the device's memory holds when buckets.batch_sizes
// is empty: engine/bucket_sizing.h), static input/output buffers, and a StepRunner that either
// replays a CUDA graph captured per bucket (CUDA builds, CUDA device) or runs the same code eagerly
// (CPU, or capture switched off). It knows nothing about gRPC.
//
//   EngineOptions opt;  opt.device = at::kCUDA;  opt.dtype = at::kBFloat16;
//   Engine engine(LoadModel(dir), opt);
//   engine.Warmup();                                   // captures every bucket, logs a summary
//   auto outputs = engine.Generate({request});         // run to completion
//
// Continuous batching (what the server's scheduler does): Admit() new requests while slots and KV
// pages are free (vision + prefill, first token sampled), Step() once per decode iteration for
// every active sequence; a finished sequence frees its slot and pages at once and the next
// Admit() can use them.
//
// Note [KV pages per sequence]:
//   A sequence takes, at admission, the pages that its prompt and max_new_tokens can fill:
//   KvPagesFor(min(prompt + max_new_tokens, longest context)), and keeps them until it ends, so a
//   running sequence never waits for memory and none is preempted (TGI's reservation by
//   max_new_tokens; vLLM instead grows sequences page by page and preempts when pages run out).
//   Its slot's page-table row names them (written before its prefill, stream-ordered); the rest
//   of the row, and every entry of a free slot, is 0, the scratch page, so padding rows and the
//   one extra step an overlapped decode runs for a sequence that ended on a stop token write
//   there or past the sequence's end, never into another sequence's pages. Requests that leave
//   max_new_tokens unset take pages for the whole context: clients that set it (OpenAI's
//   max_tokens) fit more streams. With buckets.batch_sizes given, the cache has pages for every
//   slot at the longest context; derived, it has what memory holds (engine/bucket_sizing.h).
//
// Thread rules: an Engine is driven by ONE thread, the GPU thread: the constructor, Warmup, Admit,
// Step, Cancel, Generate, Forward. Validate(), Counters(), Memory() and the accessors are safe from
// any thread. Errors: EngineError (engine_types.h); std::invalid_argument from the model is
// converted to kInvalidArgument.
#pragma once

#include <ATen/Tensor.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "engine/bucket.h"
#include "engine/dispatch.h"
#include "engine/engine_types.h"
#include "engine/kv_page_pool.h"
#include "engine/step_runner.h"
#include "model/vision_language_model.h"

namespace vlmgraph {

struct EngineOptions {
  at::Device device = at::kCPU;
  at::ScalarType dtype = at::kFloat;  // kFloat or kBFloat16
  BucketSpec buckets;
  bool cuda_graphs = true;    // replay CUDA graphs (CUDA builds and devices only)
  bool lazy_capture = false;  // capture a bucket on first use instead of in Warmup()
  // Chain the fused decode kernels with programmatic dependent launch (Hopper and newer; process-
  // wide, model/fused_ops.h): set by the constructor, before any capture.
  bool programmatic_dependent_launch = true;
  int64_t max_tiles_per_request =
      0;  // 0 = derived from the model: (max_img_size/vit_img_size)^2 + 1
  // The most new tokens one request may ask for (the server's limits.max_new_tokens); 0 = only
  // the context bounds them.
  int64_t max_new_tokens_limit = 0;
  // KV pages sequences may hold (model/kv_cache.h; the scratch page not counted): 0 = as memory
  // holds when buckets.batch_sizes is empty, else every slot's longest context. Set (vLLM's
  // num_gpu_blocks_override), it must hold one sequence of the longest context.
  int64_t kv_cache_pages = 0;
  bool log_captures = true;  // one log line per capture and a summary (stderr)
  // The graph checks (Notes [Static input check] and [Output lifetime check] in
  // engine/step_runner.h). Unset: GraphChecksByDefault() (builds without NDEBUG, or
  // VLMGRAPH_CHECK_GRAPHS=1).
  std::optional<bool> check_graphs;
  // Overlapped decode steps (see Step()): queue decode step N + 1, fed with step N's tokens on the
  // device, before waiting for step N's tokens on the host, so the GPU never idles through the
  // engine's host work between steps. Unset: on for CUDA devices, off on CPU (where work runs as
  // it is queued, so overlapping would only delay each token by one step).
  std::optional<bool> overlap_decode_steps;
};

class Engine;

// A request that Engine::Validate accepted (GenerateRequest or ForwardRequest); only Validate
// makes one, so whoever holds it (the server's scheduler queue, Engine::Admit, Engine::Forward)
// never checks it again. It is valid for the engine that made it: the checks read that engine's
// model and buckets. Thread rules: a value type.
template <typename Request>
class Validated {
 public:
  const Request& get() const { return request_; }
  const Request* operator->() const { return &request_; }

 private:
  friend class Engine;
  explicit Validated(Request request) : request_(std::move(request)) {}
  Request request_;
};
using ValidatedRequest = Validated<GenerateRequest>;
using ValidatedForward = Validated<ForwardRequest>;

class Engine {
 public:
  using Clock = std::chrono::steady_clock;

  Engine(VisionLanguageModel model, EngineOptions options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Captures every configured bucket of the vision, prefill and decode regions (largest first,
  // one shared graph pool), unless graphs are off or capture is lazy. Idempotent.
  void Warmup();

  // The one validation of a generation request, for every API (the server's protocol layers only
  // parse): the prompt shorter than the longest context, ids inside the vocabulary, image-token
  // count equal to tiles x mp_image_token_length, tile shape (N, 3, S, S), prompt within the
  // largest prefill bucket when the oversize policy is reject, max_new_tokens >= 1 and within
  // max_new_tokens_limit, prompt + max_new_tokens within the longest context, sampling parameters
  // in range when sampling (temperature > 0 and finite, top_p in (0, 1], top_k >= 0), stop ids
  // inside the vocabulary; checked in that order. Returns the request as a ValidatedRequest, which
  // the server's scheduler and Admit carry without checking again. Throws
  // EngineError(kInvalidArgument) saying what to change, with field() naming the field at fault
  // and context_overflow() set when the context is too short.
  ValidatedRequest Validate(GenerateRequest request) const;

  // --- continuous batching (GPU thread) ---------------------------------------------------------
  int64_t FreeSlots() const;
  int64_t ActiveSequences() const;
  // KV pages free now, and the pages `request` takes when admitted (Note [KV pages per
  // sequence]); at most the pages of the longest context, which an empty cache always has.
  int64_t FreeKvPages() const;
  int64_t KvPagesFor(const ValidatedRequest& request) const;
  // How many of `requests`, from the first, Admit takes now: each needs a free slot and its
  // KvPagesFor pages (first come, first served: a request that does not fit stops the count).
  int64_t AdmissibleCount(const std::vector<const ValidatedRequest*>& requests) const;
  // Admits requests, validated by this engine's Validate, that AdmissibleCount takes. Runs vision
  // and prefill in bucket-sized groups and samples each first token; appends one TokenEvent per
  // request to `events` (finished when max_new_tokens == 1 or a stop token came). Throws
  // EngineError(kResourceExhausted) when more requests than free slots, or than free KV pages
  // hold, are given. If it throws, none of the requests holds a slot or pages (events already
  // appended name sequences that no longer exist).
  std::vector<SequenceId> Admit(std::vector<ValidatedRequest> requests,
                                std::vector<TokenEvent>* events);
  // One decode step for every active sequence; appends one TokenEvent per sequence that was
  // active when the step was queued and still is (none for a sequence cancelled since).
  //
  // Overlapped steps (EngineOptions::overlap_decode_steps): a call queues the next step before it
  // waits for the tokens it returns, so on return one step stays queued on the device. That step
  // feeds each row the token of the step before it straight from device memory (greedy or
  // sampled) and skips rows whose sequence is sure to end (max_new_tokens, context full); a row
  // whose sequence ends on a stop token, or is cancelled, is computed once more and its token
  // dropped (its KV cache write lands past the sequence's end, where no later read looks before
  // a later write). Sequences admitted in between join the next queued step with their first
  // token from the host. Tokens, their order, per-sequence sampling streams and finish reasons
  // are those of non-overlapped steps. If a call throws, the queued step is dropped: no sequence
  // has advanced past what was returned, and the next call starts again from the host tokens.
  void Step(std::vector<TokenEvent>* events);
  // Ends a sequence now and frees its slot; unknown or finished ids are ignored.
  void Cancel(SequenceId id);
  // Ends every sequence and drops the queued decode step (after a failed step, so that no slot
  // stays held by a sequence nobody reads).
  void CancelAll();
  // DeviceFault (engine/device.h) of the engine's device: "" while it can run work. GPU thread.
  std::string DeviceFault() const;

  // Validates `requests` (all before any runs), runs them to completion with continuous
  // batching and returns each request's new tokens.
  std::vector<std::vector<int64_t>> Generate(std::vector<GenerateRequest> requests);

  // The one validation of a scoring request: prompt checks as for generation (ids, image tokens,
  // tiles, at most the longest context, the oversize policy), target_ids as long as the prompt
  // with ids in the vocabulary or -100, logits_positions inside the prompt. Throws
  // EngineError(kInvalidArgument) saying what to change, with field() naming the field at fault.
  ValidatedForward Validate(ForwardRequest request) const;

  // Scores one prompt: vision + the prefill region (graphed when a bucket fits), then loss and
  // the requested logits. Uses no KV slot.
  ForwardResult Forward(const ValidatedForward& request);

  // Diagnostics (GPU thread): runs the region of `key` `iters` times back to back on the inputs
  // its buffers hold (replays of its graph, captured first if missing, or eager calls) and returns
  // mean seconds per run, the device synchronised once at the end: the region's device time
  // without the engine's per-step host work. Regions are idempotent on unchanged inputs, but for
  // the tokens a decode region leaves for the next step, which are restored afterwards. With no
  // active sequence, a decode bucket is timed with every row attending to its full context.
  double TimeRegion(const BucketKey& key, int iters);

  // --- observation (any thread) ----------------------------------------------------------------
  EngineCounters Counters() const;
  MemoryStats Memory() const;
  void SetObserver(EngineObserver* observer);  // before Warmup; nullptr = none
  EngineObserver* observer() const { return observer_; }  // SetObserver's, or nullptr
  const VlmConfig& model_config() const { return model_->cfg; }
  const EngineOptions& options() const { return options_; }
  bool graphs_enabled() const;
  int64_t max_context() const { return options_.buckets.max_context(); }
  VisionLanguageModel& model() { return model_; }

 private:
  struct Sequence;
  struct Buffers;
  struct QueuedStep;

  // Fills the empty buckets.batch_sizes from the device's free memory, the weights already on it
  // (engine/bucket_sizing.h, Note [Decode slots from device memory]), and logs the arithmetic.
  // Throws EngineError: kInvalidArgument on a CPU device, kResourceExhausted when no slot fits.
  void DeriveBatchSizes();
  // The region function of a bucket, over the static buffers.
  RegionFn MakeRegionFn(const BucketKey& key);
  // Runs a vision or prefill region through the dispatcher (engine/dispatch.h: the smallest
  // bucket that fits, else `exact_fn` eagerly), waits for it and records it (runs, captures, real
  // and padded tokens, latency). Decode steps dispatch in QueueDecode and record in FinishDecode.
  DispatchResult Dispatch(const std::optional<BucketKey>& bucket, const BucketKey& exact,
                          const RegionDispatcher::BucketedFn& bucketed, const RegionFn& exact_fn,
                          int64_t real_tokens);
  // Records one run of a region: CountRun its counters (runs, captures, real and padded tokens;
  // an exact-shape run, !bucketed, counts under "<region>/exact"), ObserveTime its latency for
  // the observer; Count both.
  void Count(const BucketKey& key, RunKind kind, double seconds, int64_t real, int64_t padded,
             bool bucketed);
  void CountRun(const BucketKey& key, RunKind kind, int64_t real, int64_t padded, bool bucketed);
  void ObserveTime(const BucketKey& key, RunKind kind, double seconds);
  // Counts a shape with no bucket that runs eagerly and tells the observer (the dispatcher's
  // fallback callback).
  void CountEagerFallback(const BucketKey& exact, const std::string& reason);
  // Request tiles (N, 3, S, S), any dtype, on the engine's device in its dtype.
  at::Tensor ToDevice(const at::Tensor& tiles) const;
  // Encodes `tiles` (N, 3, S, S) into image_rows[row_offset : row_offset + N * tokens_per_tile).
  void RunVision(const at::Tensor& tiles, int64_t row_offset);
  // Vision + prefill of `requests` (one prefill batch) through Dispatch: the smallest prefill
  // bucket that fits (FillPrefill, then the region), else `exact_fn`. outputs[0]: last-position
  // logits (n, V); outputs[1]: hidden states (rows, seq >= longest prompt, H).
  DispatchResult Prefill(const std::vector<const GenerateRequest*>& requests,
                         const std::vector<int64_t>& slots, const RegionFn& exact_fn);
  // Fills the prefill buffers for `key` (vision for the requests' tiles into image_rows, ids
  // right-padded with the pad id, KV slots, last positions); padding rows write the scratch row.
  void FillPrefill(const std::vector<const GenerateRequest*>& requests,
                   const std::vector<int64_t>& slots, const BucketKey& key);
  // Prompts at their exact shape on the device: ids (n, longest) right-padded with the pad id,
  // last positions (n), every request's tiles joined (undefined when none).
  struct ExactPrompts {
    at::Tensor ids, last, tiles;
  };
  ExactPrompts ToExactPrompts(const std::vector<const GenerateRequest*>& requests) const;
  // Eager vision + prefill at the exact shape: writes KV rows `slots` (n) when `write_cache`,
  // else runs without the cache. Returns {last-position logits (n, V), hidden (n, longest, H)}.
  std::vector<at::Tensor> PrefillExact(const ExactPrompts& prompts, const at::Tensor& slots,
                                       bool write_cache);
  // Next token for each sequence from its logits row (n, V); one host copy.
  std::vector<int64_t> SampleRows(const at::Tensor& logits, const std::vector<Sequence*>& seqs);
  void Emit(Sequence& seq, int64_t token, std::vector<TokenEvent>* events);
  // How `seq` ends, other than by a stop token, once it has the tokens of `ahead` more steps:
  // kLength (max_new_tokens reached), kContextFull (its next position is past the longest
  // context), or kNone. Emit applies it with ahead = 0 after each token.
  FinishReason EndByCount(const Sequence& seq, int64_t ahead) const;
  // Queues one decode step (inputs copied in, region launched, tokens sampled and copied towards
  // the host) for every active sequence that has a token left to generate; with `carry`, a
  // sequence already in the queued step is fed that step's token from the device. Returns
  // nullptr when no sequence qualifies. Does not wait for the device.
  std::unique_ptr<QueuedStep> QueueDecode(bool carry);
  // Waits for `step`'s tokens, advances its sequences that are still active and emits a
  // TokenEvent for each (with its logprobs when its request asked).
  void FinishDecode(QueuedStep& step, std::vector<TokenEvent>* events);
  // The logprobs of the rows of `fed` whose requests ask, from the decode region's `logits` (B, V)
  // and the step's `tokens` (B), queued into `step`'s host buffers; nothing when none asks (Note
  // [Logprobs off the graph], engine/logprobs.h). engine_logprobs.cc.
  void QueueLogprobs(const std::vector<Sequence*>& fed, const at::Tensor& logits,
                     const at::Tensor& tokens, QueuedStep* step);
  // A prefill group's logprobs, for the requests that ask: each first token's (from the region's
  // last-position logits) and each prompt's (from its hidden states, in chunks), set on events[k],
  // the k-th request's first event. Before the runner's next run. engine_logprobs.cc.
  void AttachPrefillLogprobs(const std::vector<const GenerateRequest*>& group,
                             const DispatchResult& r, const std::vector<int64_t>& tokens,
                             TokenEvent* events);
  // KvPagesFor of a request Validate accepted.
  int64_t KvPagesForRequest(const GenerateRequest& request) const;
  // Ends the sequence in `slot`: its pages go back to kv_pages_ and its page-table row to 0.
  void Free(int64_t slot);
  void ValidateTokens(const std::vector<int64_t>& ids, const at::Tensor& tiles) const;

  VisionLanguageModel model_;
  EngineOptions options_;
  std::unique_ptr<StepRunner> runner_;
  std::unique_ptr<RegionDispatcher> dispatch_;  // over runner_
  std::unique_ptr<Buffers> buffers_;
  std::vector<std::unique_ptr<Sequence>> slots_;  // one per KV cache row; nullptr = free
  bool overlap_decode_ = false;                   // options_.overlap_decode_steps resolved
  std::unique_ptr<QueuedStep> queued_;            // the decode step queued and not yet returned
  int64_t decode_launches_ = 0;                   // picks the host staging half of each step
  Clock::time_point last_decode_done_{};          // when the host saw the last step's tokens
  SequenceId next_id_ = 0;
  bool warmed_up_ = false;
  EngineObserver* observer_ = nullptr;
  KvPagePool kv_pages_;                            // the cache's free pages (GPU thread)
  std::atomic<int64_t> kv_pages_used_{0};          // kv_pages_.used_pages(), for Memory()
  int64_t derived_kv_pages_ = 0;                   // DeriveBatchSizes' pages; 0 = not derived
  std::atomic<int64_t> graph_pool_bytes_{0};       // refreshed on the GPU thread after captures
  int64_t derived_graph_pool_estimate_bytes_ = 0;  // DeriveBatchSizes' estimate; 0 = not derived
  mutable std::mutex counters_mu_;
  EngineCounters counters_;
};

}  // namespace vlmgraph
