#include "engine/dispatch.h"

#include <chrono>
#include <utility>

namespace vlmgraph {

RegionDispatcher::RegionDispatcher(StepRunner* runner, FallbackFn on_fallback)
    : runner_(runner), on_fallback_(std::move(on_fallback)) {}

DispatchResult RegionDispatcher::Run(const std::optional<BucketKey>& bucket, const BucketKey& exact,
                                     const BucketedFn& bucketed, const RegionFn& exact_fn,
                                     bool exact_requested) const {
  using Clock = std::chrono::steady_clock;
  DispatchResult r;
  if (bucket) {
    r.key = *bucket;
    r.bucketed = true;
    const RegionFn fn = bucketed(*bucket);  // fills the static buffers: not part of the run
    const auto t0 = Clock::now();
    r.kind = runner_->Run(*bucket, fn, /*capture_if_missing=*/runner_->captures(), &r.outputs);
    r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    return r;
  }
  r.key = exact;
  if (!exact_requested && on_fallback_) on_fallback_(exact, "no bucket fits " + exact.Label());
  const auto t0 = Clock::now();
  r.outputs = exact_fn();
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return r;
}

}  // namespace vlmgraph
