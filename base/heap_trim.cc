#include "base/heap_trim.h"

#include <chrono>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace vlmgraph {

HeapTrimmer::HeapTrimmer(double period_seconds, int64_t threshold_bytes)
    : period_seconds_(period_seconds), threshold_bytes_(threshold_bytes) {
  thread_ = std::thread([this] { Run(); });
}

HeapTrimmer::~HeapTrimmer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

int64_t HeapTrimmer::FreeHeapBytes() {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
  const struct mallinfo2 info = mallinfo2();
  return static_cast<int64_t>(info.fordblks);
#else
  return 0;
#endif
}

bool HeapTrimmer::TrimIfAbove(int64_t threshold_bytes, int64_t* free_bytes) {
  const int64_t free_now = FreeHeapBytes();
  if (free_bytes != nullptr) *free_bytes = free_now;
  if (free_now <= threshold_bytes) return false;
#if defined(__GLIBC__)
  malloc_trim(0);
  return true;
#else
  return false;
#endif
}

void HeapTrimmer::Run() {
  const auto period = std::chrono::duration<double>(period_seconds_);
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, period, [this] { return stop_; })) {
    lock.unlock();
    int64_t free_bytes = 0;
    if (TrimIfAbove(threshold_bytes_, &free_bytes)) {
      trims_.fetch_add(1);
      returned_bytes_.fetch_add(free_bytes);
    }
    lock.lock();
  }
}

}  // namespace vlmgraph
