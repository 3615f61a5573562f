// tests/server_test_util.h: helpers shared by the in-process server tests (server_test).
//
// ForwardingObserver: an EngineObserver that passes every event on to another observer (the
// engine's per-GPU EngineMetrics), for test observers that add a fault or a delay to one event:
//   class Gate : public ForwardingObserver {
//     using ForwardingObserver::ForwardingObserver;
//     void OnStep(const BucketKey& k, bool graphed, double s) override {
//       ForwardingObserver::OnStep(k, graphed, s);  /* then the test's part */
//     }
//   };
// StreamGenerate: one gRPC Generate read to its end: its status and the token ids streamed.
// Thread rules: as the observer they forward to; StreamGenerate from any thread.
#pragma once

#include <grpcpp/client_context.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>

#include "engine/engine_types.h"
#include "vlmgraph/v1/service.grpc.pb.h"

namespace vlmgraph::server {

class ForwardingObserver : public EngineObserver {
 public:
  explicit ForwardingObserver(EngineObserver* next) : next_(next) {}
  void OnCapture(const BucketKey& key, double seconds) override { next_->OnCapture(key, seconds); }
  void OnStep(const BucketKey& key, bool graphed, double seconds) override {
    next_->OnStep(key, graphed, seconds);
  }
  void OnEagerFallback(Region region, const std::string& reason) override {
    next_->OnEagerFallback(region, reason);
  }
  void OnTokens(Region region, int64_t real, int64_t padded) override {
    next_->OnTokens(region, real, padded);
  }
  void OnBatch(Region region, int64_t real_batch) override { next_->OnBatch(region, real_batch); }

 private:
  EngineObserver* next_;
};

// Streams `request` on `stub` with a deadline `deadline` from now; returns the call's status and
// the number of token ids the chunks carried.
inline std::pair<grpc::Status, int64_t> StreamGenerate(v1::VlmGraph::Stub& stub,
                                                       const v1::GenerateRequest& request,
                                                       std::chrono::seconds deadline) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + deadline);
  auto reader = stub.Generate(&ctx, request);
  v1::GenerateResponse chunk;
  int64_t tokens = 0;
  while (reader->Read(&chunk)) {
    if (chunk.has_tokens()) tokens += chunk.tokens().token_ids_size();
  }
  return {reader->Finish(), tokens};
}

}  // namespace vlmgraph::server
