#include "server/core/tokenizer_files.h"

#include <sys/stat.h>

#include <cerrno>
#include <fstream>
#include <sstream>
#include <system_error>

#include "base/atomic_file.h"

namespace vlmgraph::server {
namespace {

bool RegularFile(const std::string& path, int64_t* bytes) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
  *bytes = static_cast<int64_t>(st.st_size);
  return true;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::system_error(errno, std::generic_category(), "read '" + path + "'");
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The same file by device and inode (a checkpoint saved over the directory it was loaded from).
bool SameFile(const std::string& a, const std::string& b) {
  struct stat sa {}, sb {};
  return ::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0 && sa.st_dev == sb.st_dev &&
         sa.st_ino == sb.st_ino;
}

}  // namespace

std::vector<TokenizerFile> TokenizerFilesBeside(const std::string& tokenizer_json) {
  std::vector<TokenizerFile> out;
  if (tokenizer_json.empty()) return out;
  const size_t slash = tokenizer_json.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : tokenizer_json.substr(0, slash);
  for (const char* name : kTokenizerFileNames) {
    TokenizerFile f;
    f.name = name;
    f.path = f.name == "tokenizer.json" ? tokenizer_json : dir + "/" + f.name;
    if (RegularFile(f.path, &f.bytes)) out.push_back(f);
  }
  return out;
}

int64_t TokenizerFilesBytes(const std::string& tokenizer_json) {
  int64_t total = 0;
  for (const TokenizerFile& f : TokenizerFilesBeside(tokenizer_json)) total += f.bytes;
  return total;
}

std::vector<std::string> CopyTokenizerFiles(const std::string& tokenizer_json,
                                            const std::string& dir) {
  std::vector<std::string> written;
  for (const TokenizerFile& f : TokenizerFilesBeside(tokenizer_json)) {
    const std::string to = dir + "/" + f.name;
    if (SameFile(f.path, to)) continue;
    WriteFileAtomically(to, ReadFile(f.path));
    written.push_back(f.name);
  }
  return written;
}

}  // namespace vlmgraph::server
