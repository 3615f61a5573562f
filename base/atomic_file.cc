#include "base/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <system_error>
#include <utility>

namespace vlmgraph {
namespace {

[[noreturn]] void Fail(int error, const std::string& what) {
  throw std::system_error(error, std::generic_category(), what);
}

}  // namespace

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)), tmp_(path_ + ".tmp") {
  // A leftover of a crashed save, or an entry planted there: only the entry goes, never what a
  // link points to.
  if (::unlink(tmp_.c_str()) != 0 && errno != ENOENT) Fail(errno, "remove '" + tmp_ + "'");
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd_ < 0) Fail(errno, "create '" + tmp_ + "'");
}

AtomicFile::~AtomicFile() { Discard(); }

void AtomicFile::Discard() {
  if (done_) return;
  done_ = true;
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  ::unlink(tmp_.c_str());
}

void AtomicFile::Write(const void* data, size_t bytes) {
  if (done_) Fail(EBADF, "write '" + tmp_ + "' after it was committed or discarded");
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd_, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int error = n < 0 ? errno : EIO;
      Discard();
      Fail(error, "write '" + tmp_ + "'");
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

void AtomicFile::Commit() {
  if (done_) Fail(EBADF, "commit '" + tmp_ + "' after it was committed or discarded");
  // close() reports errors of delayed writes (NFS, quotas).
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0) {
    const int error = errno;
    Discard();
    Fail(error, "close '" + tmp_ + "'");
  }
  if (std::rename(tmp_.c_str(), path_.c_str()) != 0) {
    const int error = errno;
    Discard();
    Fail(error, "rename '" + tmp_ + "' to '" + path_ + "'");
  }
  done_ = true;
}

void WriteFileAtomically(const std::string& path, const std::string& text) {
  AtomicFile out(path);
  out.Write(text.data(), text.size());
  out.Commit();
}

}  // namespace vlmgraph
