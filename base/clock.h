// base/clock.h: elapsed time on the monotonic clock (std::chrono::steady_clock), for request
// latencies, queue, step and capture times. Any thread.
#pragma once

#include <chrono>

namespace vlmgraph {

// Seconds from `t0` to now on std::chrono::steady_clock.
inline double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace vlmgraph
