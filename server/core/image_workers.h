// server/core/image_workers.h: the few fixed threads that decode and tile request images.
//
// Image preprocessing (PNG/JPEG decoding, ATen's antialiased bicubic resize, tiling:
// image/image_processor.h) runs ATen ops whose intra-op parallelism (OpenMP) gives every thread
// that calls them a team of at::get_num_threads() - 1 worker threads of its own, kept for as long
// as that thread lives. Threads that prepare requests are many (http.workers, the gRPC service's
// Generate prepare threads, and gRPC's synchronous server grows its own for Forward and Train),
// so preprocessing on them leaves up to threads x cores threads (and their stacks) behind. Running it on a few fixed
// threads bounds that to image_worker_threads() x cores, and bounds the CPU that images take from
// the engine's thread.
//
//   ImageTiles t = RunImageWork([&] { return PreprocessEncodedImage(bytes, cfg, limits); });
//
// Thread rules: RunImageWork is safe from any thread: it queues `work`, blocks until a pool
// thread ran it, and returns its value or rethrows its exception (called from a pool thread, it
// runs `work` inline). The pool starts on first use with min(4, hardware threads) threads and
// stops at process exit.
#pragma once

#include <functional>
#include <future>
#include <memory>
#include <type_traits>
#include <utility>

namespace vlmgraph::server {

// Runs `task` on a pool thread (inline on a pool thread) and returns when it has run.
void RunOnImageWorker(const std::function<void()>& task);

// Threads of the pool.
int image_worker_threads();

template <typename Work>
auto RunImageWork(Work&& work) -> std::invoke_result_t<Work&> {
  using Result = std::invoke_result_t<Work&>;
  std::packaged_task<Result()> task(std::ref(work));
  std::future<Result> result = task.get_future();
  RunOnImageWorker([&task] { task(); });
  return result.get();
}

}  // namespace vlmgraph::server
