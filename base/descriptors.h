// base/descriptors.h: the process's file descriptors (every connection of both fronts is one).
//
//   RaiseDescriptorLimit();                      // soft RLIMIT_NOFILE up to the hard one, once
//   DescriptorUse use = ReadDescriptorUse();     // open now, and the limit
//   int64_t http_max = ConnectionsWithinDescriptors(16384, use);
//
// Note [Descriptor reserve]: a process that runs out of descriptors fails every accept, open and
// socket call: gRPC 1.51's listener stops for good at its first failed accept4 (server/grpc/
// grpc_server.h, Note [gRPC listener]), and a checkpoint or log file cannot be opened. So the
// HTTP front takes at most limit - open at start-up - reserve connections, the reserve being a
// quarter of the limit and at least 64 descriptors: room for gRPC's connections, the files a
// Train job writes and the CUDA driver. nginx's worker_connections must likewise stay under
// worker_rlimit_nofile.
//
// Thread rules: every function is safe from any thread. Errors: none (what cannot be read reads 0).
#pragma once

#include <cstdint>

namespace vlmgraph {

struct DescriptorUse {
  int64_t open = 0;   // descriptors open now (/proc/self/fd)
  int64_t limit = 0;  // RLIMIT_NOFILE's soft limit
};

// Raises the soft RLIMIT_NOFILE to the hard one (as nginx's worker_rlimit_nofile and Go's runtime
// do); returns the soft limit after it.
int64_t RaiseDescriptorLimit();

// Counts /proc/self/fd: O(open descriptors), a few milliseconds for 20,000.
DescriptorUse ReadDescriptorUse();

// Note [Descriptor reserve]: the connections the HTTP front may take of `wanted`, given the
// descriptors open and the limit at start-up: min(wanted, limit - open - max(64, limit / 4)),
// at least 16.
int64_t ConnectionsWithinDescriptors(int64_t wanted, const DescriptorUse& use);

}  // namespace vlmgraph
