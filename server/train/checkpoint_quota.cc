#include "server/train/checkpoint_quota.h"

#include <filesystem>
#include <iterator>
#include <system_error>
#include <vector>

#include "base/log.h"
#include "server/core/status.h"
#include "server/core/tokenizer_files.h"
#include "server/train/checkpoint_dir.h"

namespace vlmgraph::server {

namespace fs = std::filesystem;

int64_t CheckpointDirBytes(const std::string& root) {
  std::error_code ec;
  int64_t total = 0;
  fs::recursive_directory_iterator it(root, fs::directory_options::skip_permission_denied, ec);
  if (ec) return 0;
  for (const fs::recursive_directory_iterator end; it != end; it.increment(ec)) {
    if (ec) break;
    const fs::file_status st = it->symlink_status(ec);
    if (ec || !fs::is_regular_file(st)) continue;
    const auto size = it->file_size(ec);
    if (!ec) total += static_cast<int64_t>(size);
  }
  return total;
}

CheckpointUsage MeasureCheckpointUsage(const std::string& root, const CheckpointDir& dir) {
  CheckpointUsage usage;
  // The files a save writes (engine/trainer.h, SaveCheckpoint; server/core/tokenizer_files.h)
  // replace those of a checkpoint already in `dir`.
  std::vector<std::string> names = {"config.json", "model.safetensors", "optimizer.safetensors"};
  names.insert(names.end(), std::begin(kTokenizerFileNames), std::end(kTokenizerFileNames));
  for (const std::string& name : names) {
    std::error_code ec;
    const fs::path file = fs::path(dir.io_path()) / name;
    if (!fs::is_regular_file(fs::symlink_status(file, ec))) continue;
    const auto size = fs::file_size(file, ec);
    if (!ec) usage.replaced_bytes += static_cast<int64_t>(size);
  }
  usage.used_bytes = CheckpointDirBytes(root);
  return usage;
}

void CheckCheckpointQuota(const std::string& root, const CheckpointUsage& usage,
                          int64_t save_bytes, int64_t quota_bytes) {
  if (quota_bytes <= 0) return;
  const int64_t used = usage.used_bytes, replaced = usage.replaced_bytes;
  const int64_t after = used - replaced + save_bytes;
  if (after <= quota_bytes) return;
  auto mib = [](int64_t bytes) { return LogFormat("%.1f MiB", bytes / 1048576.0); };
  throw ServerError(
      grpc::StatusCode::RESOURCE_EXHAUSTED,
      "train.checkpoint_quota_bytes: this checkpoint takes up to " + mib(save_bytes) + ", and " +
          "train.checkpoint_dir (" + root + ") holds " + mib(used) +
          (replaced > 0 ? " (" + mib(replaced) + " of it replaced by this save)" : "") +
          ": " + mib(after) + " in all would pass the quota of " + mib(quota_bytes) +
          "; no file was written. Delete older checkpoints below it, save into a directory " +
          "that holds one to replace it, or raise train.checkpoint_quota_bytes");
}

}  // namespace vlmgraph::server
