// server/core/drain_batches.h: hands the streams that the GPU threads notify to a thread pool in
// batches (Note [Batched drains]).
//
//   DrainBatches<GenerateCall> drains(&stream_pool, shards);   // before the pool, see below
//   drains.Schedule(call);        // any thread: call->Drain() runs once on a pool thread
//
// Note [Batched drains]: after each decode step an engine's GPU thread notifies every stream it
// gave a token (256 per step at batch 256; about 500k notifications a second at 4 GPUs). Posting
// one pool task per notification put every GPU thread and every stream thread on the pool's one
// queue lock: at 4 x H200 with 8 stream threads the GPU threads spent 30% of their time waiting
// for it (0.70 of a core each against 1.00 with 2 stream threads) and gRPC served 342k tokens/s
// against 498k (docs/benchmarks.md, "Scaling"). DrainBatches gathers the notified streams in
// shards (by address) and posts one task per shard when the shard has none queued or running;
// that task drains every stream gathered until it finds its shard empty. A notification costs a
// shard's lock and a vector push; a pool task serves a step's worth of streams, and the shards keep
// the stream threads busy in parallel.
//
// Thread rules: Schedule from any thread. T::Drain() runs on a pool thread, never on the caller's
// thread, at most once per Schedule; a T gone by then (its last shared_ptr released) is skipped,
// as a posted task holding only a weak_ptr would. The caller keeps its own "scheduled" flag
// (cleared when its Drain starts) so that a stream waits in one shard at most once: DrainBatches
// does not deduplicate. Tasks refer to the DrainBatches: declare it before the pool in the owner
// (members are destroyed in reverse order, so the pool stops and joins its threads first).
#pragma once

#include <boost/asio/post.hpp>
#include <boost/asio/thread_pool.hpp>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "base/log.h"

namespace vlmgraph::server {

template <typename T>
class DrainBatches {
 public:
  // `pool` runs the drains (may not be constructed yet: only its address is kept); `shards` >= 1,
  // typically the pool's thread count.
  DrainBatches(boost::asio::thread_pool* pool, int shards)
      : pool_(pool),
        shard_count_(static_cast<size_t>(shards < 1 ? 1 : shards)),
        shards_(new Shard[shard_count_]) {}
  DrainBatches(const DrainBatches&) = delete;
  DrainBatches& operator=(const DrainBatches&) = delete;

  void Schedule(const std::shared_ptr<T>& item) {
    // Addresses of heap objects differ in their low bits by the allocator's alignment.
    Shard& shard = shards_[(reinterpret_cast<uintptr_t>(item.get()) >> 6) % shard_count_];
    bool post;
    {
      std::lock_guard<std::mutex> lock(shard.mu);
      shard.ready.push_back(item);
      post = !shard.posted;
      shard.posted = true;
    }
    if (post) boost::asio::post(*pool_, [this, s = &shard] { Run(*s); });
  }

 private:
  struct Shard {
    std::mutex mu;
    std::vector<std::weak_ptr<T>> ready;  // mu
    bool posted = false;                  // mu: a Run of this shard is queued or running
  };

  // One Run per shard at a time: it drains what was gathered, then what came meanwhile, and
  // clears `posted` only when it finds the shard empty (under the lock, so a Schedule that comes
  // after that posts a new Run).
  void Run(Shard& shard) {
    std::vector<std::weak_ptr<T>> batch;
    while (true) {
      {
        std::lock_guard<std::mutex> lock(shard.mu);
        if (shard.ready.empty()) {
          shard.posted = false;
          return;
        }
        batch.swap(shard.ready);  // the shard keeps the capacity of the last batch
      }
      for (const std::weak_ptr<T>& w : batch) {
        std::shared_ptr<T> item = w.lock();
        if (!item) continue;
        try {
          item->Drain();
        } catch (const std::exception& e) {  // one stream's failure must not stop its shard
          LogError(std::string("a stream's drain threw: ") + e.what());
        } catch (...) {
          LogError("a stream's drain threw");
        }
      }
      batch.clear();
    }
  }

  boost::asio::thread_pool* const pool_;
  const size_t shard_count_;
  const std::unique_ptr<Shard[]> shards_;
};

}  // namespace vlmgraph::server
