// base/descriptors.cc: see descriptors.h.
#include "base/descriptors.h"

#include <dirent.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstdint>

namespace vlmgraph {
namespace {

// The soft RLIMIT_NOFILE (INT64_MAX when unlimited, 0 when unreadable).
int64_t SoftLimit() {
  rlimit files{};
  if (getrlimit(RLIMIT_NOFILE, &files) != 0) return 0;
  return files.rlim_cur == RLIM_INFINITY ? INT64_MAX : static_cast<int64_t>(files.rlim_cur);
}

}  // namespace

int64_t RaiseDescriptorLimit() {
  rlimit files{};
  if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    setrlimit(RLIMIT_NOFILE, &files);
  }
  return SoftLimit();
}

DescriptorUse ReadDescriptorUse() {
  DescriptorUse use;
  use.limit = SoftLimit();
  if (DIR* dir = opendir("/proc/self/fd")) {
    while (const dirent* e = readdir(dir)) {
      if (e->d_name[0] != '.') ++use.open;
    }
    closedir(dir);
    use.open = std::max<int64_t>(0, use.open - 1);  // the directory's own descriptor
  }
  return use;
}

int64_t ConnectionsWithinDescriptors(int64_t wanted, const DescriptorUse& use) {
  if (use.limit <= 0 || use.limit == INT64_MAX) return wanted;
  const int64_t reserve = std::max<int64_t>(64, use.limit / 4);
  return std::min(wanted, std::max<int64_t>(16, use.limit - use.open - reserve));
}

}  // namespace vlmgraph
