// base/atomic_file.h: writing a file as a fresh temporary that is renamed into place, never
// through a symbolic link and never leaving a partial file behind.
//
// A checkpoint directory may hold entries the server did not make (a client with the train
// scope, or anyone who can write there, may plant `model.safetensors.tmp -> /etc/passwd`).
// AtomicFile removes whatever entry has the temporary's name (an unlink removes a link, not its
// target), creates the temporary with O_CREAT | O_EXCL | O_NOFOLLOW (it fails rather than open
// an entry that appeared meanwhile), and renames it over the final name, which replaces a link
// there instead of following it. A write that fails (disk full, file size limit) or an
// AtomicFile destroyed before Commit removes the temporary.
//
//   AtomicFile out(dir + "/model.safetensors");  // creates dir/model.safetensors.tmp
//   out.Write(header.data(), header.size());
//   out.Commit();                                // renames it to dir/model.safetensors
//
// The directory's own components are not checked here (OpenCheckpointDir in
// server/train/checkpoint_dir.h opens them without following links, and passes the opened
// directory as /proc/self/fd/N).
// Thread rules: one thread per AtomicFile; two writers of the same path race (the second one's
// open fails). Errors: std::system_error naming the file and the
// errno (its what() reads e.g. "write 'x.tmp': No space left on device").
#pragma once

#include <cstddef>
#include <string>

namespace vlmgraph {

class AtomicFile {
 public:
  // Creates `path` + ".tmp" (mode 0644 before the umask).
  explicit AtomicFile(std::string path);
  // Removes the temporary unless Commit() succeeded.
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  AtomicFile(AtomicFile&&) = delete;
  AtomicFile& operator=(AtomicFile&&) = delete;

  // Appends `bytes` bytes; on failure the temporary is removed before the error is thrown.
  void Write(const void* data, size_t bytes);
  // Closes the temporary and renames it to the final path.
  void Commit();

  const std::string& temporary_path() const { return tmp_; }

 private:
  void Discard();  // closes and removes the temporary; no-op once done

  std::string path_, tmp_;
  int fd_ = -1;
  bool done_ = false;
};

// Writes `text` to `path` through an AtomicFile.
void WriteFileAtomically(const std::string& path, const std::string& text);

}  // namespace vlmgraph
