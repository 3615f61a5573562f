// server/train/checkpoint_dir.cc: see checkpoint_dir.h.
#include "server/train/checkpoint_dir.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "server/core/status.h"

namespace vlmgraph::server {
namespace {

// Note [Checkpoint directories]: SaveCheckpoint.directory (and TrainConfig.save_directory,
// resume_from) is a client's name for a directory that must stay inside train.checkpoint_dir. It
// is checked by name (no "", ".", ".." components, the characters the proto allows, NAME_MAX per
// component), then opened one component at a time from the opened canonical root with
// openat(O_DIRECTORY | O_NOFOLLOW): a component that is a symbolic link (which could point
// anywhere) or a file is refused, a missing one is made with mkdirat when the caller creates.
// Every read and write of the checkpoint then goes through the opened directory
// (/proc/self/fd/N, CheckpointDir::io_path), and the files in it through AtomicFile (O_NOFOLLOW,
// rename): swapping a component of the path for a link after the check moves nothing outside
// the root, the save lands in the directory that was checked. POSIX calls, not std::filesystem:
// the pip LibTorch exports its own copy of std::filesystem (see tests/server_scheduler_test.cc).

// `path` made absolute and lexically normal: "/a/b", no ".", "..", "" components.
std::string AbsoluteNormal(const std::string& path) {
  std::string joined = path;
  if (joined.empty() || joined.front() != '/') {
    char* cwd = ::getcwd(nullptr, 0);
    joined = std::string(cwd ? cwd : "/") + "/" + joined;
    std::free(cwd);
  }
  std::vector<std::string> parts;
  std::stringstream ss(joined);
  for (std::string part; std::getline(ss, part, '/');) {
    if (part.empty() || part == ".") continue;
    if (part == "..") {
      if (!parts.empty()) parts.pop_back();
    } else {
      parts.push_back(part);
    }
  }
  std::string out;
  for (const std::string& part : parts) out += "/" + part;
  return out.empty() ? "/" : out;
}

// std::filesystem::weakly_canonical of an AbsoluteNormal path: its longest existing prefix
// resolved by realpath(3) (symbolic links followed), the rest appended as it is.
std::string WeaklyCanonical(const std::string& path) {
  std::string prefix = path, rest;
  while (true) {
    if (char* real = ::realpath(prefix.empty() ? "/" : prefix.c_str(), nullptr)) {
      std::string out(real);
      std::free(real);
      if (!rest.empty()) out += (out.back() == '/' ? "" : "/") + rest;
      return out;
    }
    const size_t slash = prefix.rfind('/');
    if (slash == std::string::npos) return path;
    rest = rest.empty() ? prefix.substr(slash + 1) : prefix.substr(slash + 1) + "/" + rest;
    prefix.resize(slash);
  }
}

}  // namespace

std::string CheckpointDir::io_path() const {
  return fd ? "/proc/self/fd/" + std::to_string(*fd) : path;
}

std::vector<std::string> CheckpointDirComponents(const std::string& name,
                                                 const std::string& field) {
  constexpr size_t kMaxNameBytes = 1024;
  constexpr size_t kMaxComponentBytes = 255;  // NAME_MAX of Linux file systems
  if (name.empty()) throw InvalidArgument(field + ": must not be empty");
  if (name.size() > kMaxNameBytes) {
    throw InvalidArgument(field + ": " + std::to_string(name.size()) + " bytes; at most " +
                          std::to_string(kMaxNameBytes));
  }
  const bool chars_ok = std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-' ||
           c == '/';
  });
  if (!chars_ok)
    throw InvalidArgument(field + ": only letters, digits, '.', '_', '-' and '/' are allowed");
  if (name.front() == '/')
    throw InvalidArgument(field + ": must be relative to train.checkpoint_dir");
  std::vector<std::string> parts;
  for (size_t start = 0;;) {
    const size_t slash = name.find('/', start);
    parts.push_back(name.substr(start, slash == std::string::npos ? slash : slash - start));
    if (slash == std::string::npos) break;
    start = slash + 1;
  }
  for (const std::string& part : parts) {
    if (part == "..") throw InvalidArgument(field + ": must not contain '..'");
    if (part.empty() || part == ".") {
      throw InvalidArgument(field + ": '" + name +
                            "' has an empty or '.' component; name a directory below "
                            "train.checkpoint_dir, e.g. run1/step_100");
    }
    if (part.size() > kMaxComponentBytes) {
      throw InvalidArgument(field + ": a component of " + std::to_string(part.size()) +
                            " bytes; at most " + std::to_string(kMaxComponentBytes) + " each");
    }
  }
  return parts;
}

CheckpointDir OpenCheckpointDir(const std::string& root, const std::string& name,
                                const std::string& field, bool create) {
  const std::vector<std::string> parts = CheckpointDirComponents(name, field);
  // Note [Checkpoint directories]
  CheckpointDir out;
  out.path = WeaklyCanonical(AbsoluteNormal(root));
  // What the file system refused, for FAILED_PRECONDITION: the checkpoint's path, then why.
  const std::string target = out.path + (out.path.back() == '/' ? "" : "/") + name;
  const std::string refused =
      field + (create ? ": cannot write the checkpoint to " : ": cannot read the checkpoint in ") +
      target + ": ";
  auto owned = [](int fd) {
    return std::shared_ptr<int>(new int(fd), [](int* p) {
      ::close(*p);
      delete p;
    });
  };
  const int root_fd = ::open(out.path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (root_fd < 0 && !(errno == ENOENT && create)) {
    throw ServerError(grpc::StatusCode::FAILED_PRECONDITION,
                      refused + "cannot open train.checkpoint_dir: " + std::strerror(errno));
  }
  std::shared_ptr<int> dir;
  if (root_fd >= 0) {
    dir = owned(root_fd);
  } else {
    // The root itself is the server's configuration (links allowed): made as mkdir -p would.
    for (size_t slash = out.path.find('/', 1);; slash = out.path.find('/', slash + 1)) {
      const std::string made = out.path.substr(0, slash);
      if (::mkdir(made.c_str(), 0755) != 0 && errno != EEXIST) {
        throw ServerError(grpc::StatusCode::FAILED_PRECONDITION,
                          refused + "cannot make train.checkpoint_dir: " + std::strerror(errno));
      }
      if (slash == std::string::npos) break;
    }
    const int fd = ::open(out.path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) {
      throw ServerError(grpc::StatusCode::FAILED_PRECONDITION,
                        refused + "cannot open train.checkpoint_dir: " + std::strerror(errno));
    }
    dir = owned(fd);
  }
  constexpr int kComponent = O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC;
  std::string shown;  // the part of `name` opened so far
  for (const std::string& part : parts) {
    out.path += (out.path.back() == '/' ? "" : "/") + part;
    shown += (shown.empty() ? "" : "/") + part;
    int fd = ::openat(*dir, part.c_str(), kComponent);
    if (fd < 0 && errno == ENOENT && create) {
      if (::mkdirat(*dir, part.c_str(), 0755) != 0 && errno != EEXIST) {
        throw ServerError(grpc::StatusCode::FAILED_PRECONDITION,
                          refused + "cannot make '" + shown + "': " + std::strerror(errno));
      }
      fd = ::openat(*dir, part.c_str(), kComponent);
    }
    if (fd < 0) {
      const int error = errno;
      struct stat st {};
      const bool stat_ok = ::fstatat(*dir, part.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0;
      if (stat_ok && S_ISLNK(st.st_mode)) {
        throw InvalidArgument(field + ": '" + shown +
                              "' is a symbolic link; checkpoints must stay inside "
                              "train.checkpoint_dir");
      }
      if (stat_ok && !S_ISDIR(st.st_mode)) {
        throw InvalidArgument(field + ": '" + shown +
                              "' is a file, not a directory; choose another name");
      }
      if (error == ENOENT) {
        throw InvalidArgument(field + ": '" + shown + "' does not exist in train.checkpoint_dir");
      }
      throw ServerError(grpc::StatusCode::FAILED_PRECONDITION,
                        refused + "cannot open '" + shown + "': " + std::strerror(error));
    }
    dir = owned(fd);
  }
  out.fd = std::move(dir);
  return out;
}

}  // namespace vlmgraph::server
