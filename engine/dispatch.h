// engine/dispatch.h: how a batch's region runs: from the graph of the smallest bucket that fits
// the batch, or eagerly at the batch's exact shape.
//
// A batch runs in the smallest bucket that fits it, from that bucket's CUDA graph (captured on
// first use when the runner captures and the bucket has none yet); when no bucket fits, it runs
// eagerly at its own exact shape and counts as an eager fallback. This is the role of vLLM's
// CudagraphDispatcher (vllm/v1/cudagraph_dispatcher.py), which picks a captured graph or eager
// mode per batch. Every region sized by a batch goes through it: the engine's vision, prefill and
// decode steps and Forward, and the trainer's micro-steps. Two callers drive the StepRunner
// directly, having no batch to fit into a bucket: the trainer's optimizer step (one fixed shape,
// kOptimizerKey in engine/trainer_internal.h) and Engine::TimeRegion (which times the bucket it is
// given).
//
//   RegionDispatcher dispatch(runner, [](const BucketKey& exact, const std::string& reason) {
//     /* count the fallback, tell the observer */
//   });
//   DispatchResult r = dispatch.Run(
//       spec.PickPrefill(n, len),                  // the bucket, or nullopt when none fits
//       BucketKey{Region::kPrefill, n, len, 0},    // the exact shape
//       [&](const BucketKey& key) {                // fills the static buffers for `key`,
//         return MakeRegionFn(key);                //   returns the region function over them
//       },
//       [&] { return RunEagerly(); });             // the exact shape, eagerly
//
// Thread rules: Run is called from the thread that drives the runner (the engine's GPU thread or
// the trainer's caller); a dispatcher holds no state of its own besides the runner pointer and
// the fallback callback. Errors: whatever the callbacks or the runner throw, unchanged.
#pragma once

#include <ATen/Tensor.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "engine/bucket.h"
#include "engine/step_runner.h"

namespace vlmgraph {

struct DispatchResult {
  // The bucket that ran, or the exact shape when none did.
  BucketKey key;
  // kReplay / kCaptureAndReplay for a graphed bucket; kEager for an eager runner's bucket and for
  // the exact shape.
  RunKind kind = RunKind::kEager;
  bool bucketed = false;  // a bucket ran (false: the exact shape ran)
  // Host seconds of the run (the runner's call, a capture included, or exact_fn), not of filling
  // the buffers. Device work may still be queued: callers that time the device synchronise.
  double seconds = 0;
  // The region's outputs. For a graphed bucket these are the graph's static outputs, which the
  // bucket's next replay overwrites: consume (or clone) them before running it again.
  std::vector<at::Tensor> outputs;
};

class RegionDispatcher {
 public:
  // Called once per exact-shape run that was not asked for (no bucket fits): `reason` reads "no
  // bucket fits <label>".
  using FallbackFn = std::function<void(const BucketKey& exact, const std::string& reason)>;
  // Fills the static buffers for a bucket and returns the region function that reads them.
  using BucketedFn = std::function<RegionFn(const BucketKey& bucket)>;

  // `runner` must outlive the dispatcher.
  RegionDispatcher(StepRunner* runner, FallbackFn on_fallback);

  // Runs `bucketed(*bucket)` through the runner when `bucket` is set, else `exact_fn` eagerly.
  // `exact_requested`: the caller asked for exact shapes (e.g. TrainOptions::exact_shapes), so
  // running `exact_fn` is not a fallback and is not reported.
  DispatchResult Run(const std::optional<BucketKey>& bucket, const BucketKey& exact,
                     const BucketedFn& bucketed, const RegionFn& exact_fn,
                     bool exact_requested = false) const;

 private:
  StepRunner* runner_;
  FallbackFn on_fallback_;
};

}  // namespace vlmgraph
