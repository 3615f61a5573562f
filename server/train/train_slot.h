// server/train/train_slot.h: the Train RPC's one-job slot.
//
// One training job runs at a time: a Train call that finds a job running gets RESOURCE_EXHAUSTED.
// A job whose stream has ended (the client cancelled or closed it, or train.idle_timeout_seconds
// cancelled it) still takes a moment to end on the server: a final autosave, destroying the job
// on the GPU thread and giving its memory back. MarkEnding() says so before the client can learn
// that the job ended, and a Train call that arrives meanwhile waits for that job to leave the slot
// instead of being refused: the slot is free, for clients, from the moment the end is reported.
//
//   TrainSlot slot;                                          // one per service
//   slot.Acquire([&] { return context->IsCancelled(); });   // in a Train handler
//   ... on the idle watchdog's thread: slot.MarkEnding(); context->TryCancel();
//   slot.Release();                                          // after the job is destroyed
//
// Thread rules: every method is safe from any thread. Errors (ServerError): Acquire throws
// RESOURCE_EXHAUSTED while a job runs, or when an ending job has not left the slot within
// kMaxEndingWait; CANCELLED when `cancelled` turns true while it waits.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>

#include "server/core/status.h"

namespace vlmgraph::server {

class TrainSlot {
 public:
  // How long Acquire waits for an ending job (its final autosave writes the whole checkpoint).
  static constexpr std::chrono::seconds kMaxEndingWait{60};

  // Takes the slot for a new job; see the file comment. `cancelled` is polled every 50 ms while
  // waiting (the waiting call was cancelled or passed its deadline).
  void Acquire(const std::function<bool()>& cancelled) {
    std::unique_lock<std::mutex> lock(mu_);
    const auto give_up = std::chrono::steady_clock::now() + kMaxEndingWait;
    while (state_ == State::kEnding) {
      if (cancelled && cancelled()) {
        throw ServerError(grpc::StatusCode::CANCELLED,
                          "cancelled while the previous training job was ending");
      }
      if (std::chrono::steady_clock::now() >= give_up) break;
      cv_.wait_for(lock, std::chrono::milliseconds(50));
    }
    if (state_ == State::kRunning) {
      throw ServerError(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        "a training job is already running (one at a time); retry when it ends");
    }
    if (state_ == State::kEnding) {
      throw ServerError(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        "the previous training job is still ending (saving its checkpoint or "
                        "releasing its memory); retry later");
    }
    state_ = State::kRunning;
  }

  // The job that holds the slot is ending: Train calls from now on wait for Release().
  void MarkEnding() {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_ == State::kRunning) state_ = State::kEnding;
  }

  // The job has left: the slot is free.
  void Release() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      state_ = State::kFree;
    }
    cv_.notify_all();
  }

 private:
  enum class State { kFree, kRunning, kEnding };
  std::mutex mu_;
  std::condition_variable cv_;
  State state_ = State::kFree;
};

}  // namespace vlmgraph::server
