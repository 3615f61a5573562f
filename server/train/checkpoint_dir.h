// server/train/checkpoint_dir.h: a checkpoint directory a client names (SaveCheckpoint.directory,
// TrainConfig.save_directory and resume_from), checked by name and opened below
// train.checkpoint_dir without following a symbolic link (Note [Checkpoint directories] in
// checkpoint_dir.cc). Errors: ServerError INVALID_ARGUMENT for a bad name, a link or a file in the
// way; FAILED_PRECONDITION when the file system refuses. Thread rules: pure functions.
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace vlmgraph::server {

// A checkpoint directory below train.checkpoint_dir, held open (Note [Checkpoint directories] in
// checkpoint_dir.cc). Copies share the open directory; the last one closes it.
struct CheckpointDir {
  std::string path;           // absolute, below the canonical root: what clients and logs see
  std::shared_ptr<int> fd;    // the directory, opened component by component

  // The path every read and write of the checkpoint goes through while this is alive:
  // /proc/self/fd/N, i.e. the directory that was opened, whatever its path names meanwhile.
  std::string io_path() const;
};

// `name` relative to `root` (SaveCheckpoint.directory rules: only [A-Za-z0-9._/-], not absolute,
// no "", "." or ".." components, at most 1024 bytes and 255 per component), opened below the
// canonical `root` one component at a time without following a symbolic link (openat with
// O_NOFOLLOW), missing components created when `create` (mode 0755). INVALID_ARGUMENT when a
// component is a symbolic link or a file, or (not `create`) does not exist; FAILED_PRECONDITION
// when the root cannot be opened or a directory cannot be made. Messages start with `field`.
CheckpointDir OpenCheckpointDir(const std::string& root, const std::string& name,
                                const std::string& field = "save.directory", bool create = true);

// OpenCheckpointDir's checks of `name` alone (no file system access): its components.
std::vector<std::string> CheckpointDirComponents(const std::string& name,
                                                 const std::string& field = "save.directory");

}  // namespace vlmgraph::server
