// server/core/drain_batches.h: every Schedule is followed by a Drain on a pool thread, never on the
// caller's; a stream scheduled while its drain runs is drained again; a stream released before
// its batch runs is skipped; a drain that throws does not stop its shard. Also the fronts'
// thread counts (ThreadsPerEngines, server/config/config.h).
#include <gtest/gtest.h>

#include <atomic>
#include <boost/asio/thread_pool.hpp>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "server/config/config.h"
#include "server/core/drain_batches.h"

namespace vlmgraph::server {
namespace {

// A stream as the fronts keep it: a "scheduled" flag cleared when its drain starts, and a count
// of notifications (tokens) that its drains have taken.
struct FakeStream {
  std::atomic<bool> scheduled{false};
  std::atomic<int64_t> notified{0};
  std::atomic<int64_t> taken{0};
  std::atomic<int64_t> drains{0};
  std::atomic<bool> drained_on_caller{false};
  std::thread::id caller;
  bool throw_once = false;

  void Drain() {
    scheduled = false;
    ++drains;
    if (std::this_thread::get_id() == caller) drained_on_caller = true;
    taken = notified.load();
    if (throw_once) {
      throw_once = false;
      throw std::runtime_error("a drain that fails");
    }
  }
};

// Notifies `s` as a GPU thread does: counts a token, schedules unless a drain is pending.
void Notify(DrainBatches<FakeStream>& drains, const std::shared_ptr<FakeStream>& s) {
  ++s->notified;
  if (!s->scheduled.exchange(true)) drains.Schedule(s);
}

// Waits (without a time limit that could fail a slow machine: the test's own timeout is the
// bound) until every stream's drains took all its notifications.
void WaitTaken(const std::vector<std::shared_ptr<FakeStream>>& streams) {
  for (const auto& s : streams) {
    while (s->taken.load() != s->notified.load() || s->scheduled.load()) std::this_thread::yield();
  }
}

TEST(DrainBatches, EveryNotificationIsDrainedOnAPoolThread) {
  constexpr int kThreads = 4, kStreams = 300, kSteps = 200;
  std::vector<std::shared_ptr<FakeStream>> streams;
  for (int i = 0; i < kStreams; ++i) streams.push_back(std::make_shared<FakeStream>());
  {
    boost::asio::thread_pool pool(kThreads);
    DrainBatches<FakeStream> batches(&pool, kThreads);
    // Four "GPU threads", each notifying its quarter of the streams once per step.
    std::vector<std::thread> gpus;
    for (int g = 0; g < 4; ++g) {
      gpus.emplace_back([&, g] {
        for (int i = g; i < kStreams; i += 4) streams[i]->caller = std::this_thread::get_id();
        for (int step = 0; step < kSteps; ++step) {
          for (int i = g; i < kStreams; i += 4) Notify(batches, streams[i]);
        }
      });
    }
    for (auto& t : gpus) t.join();
    WaitTaken(streams);
    pool.join();
  }
  int64_t drains = 0;
  for (const auto& s : streams) {
    EXPECT_EQ(s->notified.load(), kSteps);
    EXPECT_EQ(s->taken.load(), kSteps);
    EXPECT_FALSE(s->drained_on_caller.load());
    EXPECT_GE(s->drains.load(), 1);
    EXPECT_LE(s->drains.load(), kSteps);
    drains += s->drains.load();
  }
  // Batching: at most one drain per notification, and coalescing is allowed (not required).
  EXPECT_LE(drains, int64_t{kStreams} * kSteps);
}

TEST(DrainBatches, AReleasedStreamIsSkippedAndAThrowingDrainStopsNothing) {
  boost::asio::thread_pool pool(1);
  DrainBatches<FakeStream> batches(&pool, 1);
  // Hold the one pool thread so that the batch below gathers before it runs.
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  boost::asio::post(pool, [&] {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return release; });
  });
  auto gone = std::make_shared<FakeStream>();
  std::weak_ptr<FakeStream> gone_weak = gone;
  auto failing = std::make_shared<FakeStream>();
  failing->throw_once = true;
  auto kept = std::make_shared<FakeStream>();
  Notify(batches, gone);
  Notify(batches, failing);
  Notify(batches, kept);
  gone.reset();  // released before its batch runs
  EXPECT_TRUE(gone_weak.expired());
  {
    std::lock_guard<std::mutex> lock(mu);
    release = true;
  }
  cv.notify_all();
  WaitTaken({failing, kept});
  EXPECT_EQ(failing->drains.load(), 1);
  EXPECT_EQ(kept->drains.load(), 1);
  // The shard still works after the throw.
  Notify(batches, failing);
  WaitTaken({failing});
  EXPECT_EQ(failing->drains.load(), 2);
  pool.join();
}

TEST(ServerConfig, FrontThreadsGrowWithTheEngines) {
  ServerConfig config;
  config.server.stream_threads = 0;
  config.http.io_threads = 0;
  EXPECT_EQ(StreamThreads(config, 0), 2);  // never no thread
  EXPECT_EQ(StreamThreads(config, 1), 2);
  EXPECT_EQ(StreamThreads(config, 4), 2);
  EXPECT_EQ(StreamThreads(config, 8), 4);
  EXPECT_EQ(IoThreads(config, 1), 2);
  EXPECT_EQ(IoThreads(config, 4), 8);
  config.server.stream_threads = 3;  // a set value wins
  config.http.io_threads = 5;
  EXPECT_EQ(StreamThreads(config, 8), 3);
  EXPECT_EQ(IoThreads(config, 2), 5);
}

}  // namespace
}  // namespace vlmgraph::server
