// server/checkpoint_quota.h: the Train RPC's checkpoint quota (train.checkpoint_quota_bytes):
// every file below train.checkpoint_dir together, after a save, at most the quota.
//
// A save's size is known before it writes (Trainer::checkpoint_bytes: the float32 weights, the
// AdamW state, the safetensors headers and config.json, an upper bound); the files it replaces
// (a checkpoint saved again into the same directory) are subtracted. Symbolic links below the root
// are not followed (OpenCheckpointDir refuses them as checkpoint directories anyway), so a link
// cannot make the root's size look smaller or larger than what it holds itself.
//
// Thread rules: none of its own (reads the file system). Errors: ServerError(RESOURCE_EXHAUSTED)
// naming the key, the sizes and what to do.
#pragma once

#include <cstdint>
#include <string>

namespace vlmgraph::server {

struct CheckpointDir;

// Bytes of every regular file below `root` (recursively, links not followed; entries that cannot
// be read are skipped). 0 for a root that does not exist.
int64_t CheckpointDirBytes(const std::string& root);

// Throws ServerError(RESOURCE_EXHAUSTED) when a save of `save_bytes` into `dir` (below `root`)
// would leave more than `quota_bytes` below `root`. quota_bytes 0: no quota.
void CheckCheckpointQuota(const std::string& root, const CheckpointDir& dir, int64_t save_bytes,
                          int64_t quota_bytes);

}  // namespace vlmgraph::server
