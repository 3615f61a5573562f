// base/heap_trim.h: gives the C heap's free memory back to the system while the process runs.
//
// Note [Heap trimming]: glibc's malloc keeps freed memory in its arenas (one per thread that
// allocates, up to 8 x cores) and returns it to the system only from the top of the main heap
// (M_TRIM_THRESHOLD) or for blocks it mmap'ed. Memory that a burst of large requests held in many
// small blocks (gRPC reads a message in slices of its TCP reads; a request is then parsed and
// copied) stays resident after they are gone: 24 concurrent unauthenticated 80 MB gRPC requests
// left +395 MiB resident on a 2-core CPU machine. malloc_trim(0) returns the free pages of every
// arena (madvise(MADV_DONTNEED)), which took that process from +311 MiB back to +13 MiB. A
// HeapTrimmer's thread looks every `period_seconds` at the bytes malloc holds free (mallinfo2's
// fordblks) and calls malloc_trim(0) when they pass `threshold_bytes`; so the cost (a walk of the
// arenas under their locks, milliseconds) is paid only after a burst, at most once a period.
// Other C libraries: a no-op.
//
//   HeapTrimmer trimmer;     // starts its thread
//   trimmer.trims();         // how often it gave memory back
//
// Thread rules: construct and destroy on one thread; trims() and returned_bytes() from any.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

namespace vlmgraph {

class HeapTrimmer {
 public:
  explicit HeapTrimmer(double period_seconds = 1.0, int64_t threshold_bytes = 64ll << 20);
  ~HeapTrimmer();  // stops and joins the thread
  HeapTrimmer(const HeapTrimmer&) = delete;
  HeapTrimmer& operator=(const HeapTrimmer&) = delete;

  // malloc_trim calls so far, and the free bytes malloc held before each (summed).
  int64_t trims() const { return trims_.load(); }
  int64_t returned_bytes() const { return returned_bytes_.load(); }

  // The bytes malloc holds free now (0 where unknown); one trim when above `threshold_bytes`.
  static int64_t FreeHeapBytes();
  static bool TrimIfAbove(int64_t threshold_bytes, int64_t* free_bytes = nullptr);

 private:
  void Run();

  const double period_seconds_;
  const int64_t threshold_bytes_;
  std::atomic<int64_t> trims_{0}, returned_bytes_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace vlmgraph
