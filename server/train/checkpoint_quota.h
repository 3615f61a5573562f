// server/train/checkpoint_quota.h: the Train RPC's checkpoint quota (train.checkpoint_quota_bytes):
// every file below train.checkpoint_dir together, after a save, at most the quota.
//
// A save's size is known before it writes (Trainer::checkpoint_bytes: the float32 weights, the
// AdamW state, the safetensors headers and config.json, an upper bound; plus the tokenizer files
// it copies, server/core/tokenizer_files.h); the files it replaces
// (a checkpoint saved again into the same directory) are subtracted. Symbolic links below the root
// are not followed (OpenCheckpointDir refuses them as checkpoint directories anyway), so a link
// cannot make the root's size look smaller or larger than what it holds itself.
//
// The file-system walk (MeasureCheckpointUsage) runs on the Train handler's thread; the check
// against the save's size (CheckCheckpointQuota, arithmetic only) runs where that size is known,
// on the job's GPU thread, so no directory walk holds a GPU thread.
//
// Thread rules: none of its own. Errors: ServerError(RESOURCE_EXHAUSTED) naming the key, the
// sizes and what to do.
#pragma once

#include <cstdint>
#include <string>

namespace vlmgraph::server {

struct CheckpointDir;

// Bytes of every regular file below `root` (recursively, links not followed; entries that cannot
// be read are skipped). 0 for a root that does not exist.
int64_t CheckpointDirBytes(const std::string& root);

// What a save into `dir` (below `root`) starts from: the bytes below `root`, and those of the
// files in `dir` that the save replaces (config.json, model.safetensors, optimizer.safetensors and
// the tokenizer files of server/core/tokenizer_files.h).
struct CheckpointUsage {
  int64_t used_bytes = 0;
  int64_t replaced_bytes = 0;
};
CheckpointUsage MeasureCheckpointUsage(const std::string& root, const CheckpointDir& dir);

// Throws ServerError(RESOURCE_EXHAUSTED) when a save of `save_bytes` from `usage` would leave
// more than `quota_bytes` below `root` (named in the message). quota_bytes 0: no quota.
void CheckCheckpointQuota(const std::string& root, const CheckpointUsage& usage,
                          int64_t save_bytes, int64_t quota_bytes);

}  // namespace vlmgraph::server
