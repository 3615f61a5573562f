#include "tools/train/metrics_log.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <stdexcept>

#include "base/atomic_file.h"

namespace vlmgraph::train {
namespace {

std::runtime_error Failed(const std::string& what, const std::string& path) {
  return std::runtime_error("metrics file " + path + ": cannot " + what + ": " +
                            std::strerror(errno));
}

// mkdir -p of `path`'s parent directory.
void MakeParent(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos || slash == 0) return;
  const std::string dir = path.substr(0, slash);
  for (size_t at = dir.find('/', 1);; at = dir.find('/', at + 1)) {
    const std::string part = dir.substr(0, at);
    if (::mkdir(part.c_str(), 0755) != 0 && errno != EEXIST)
      throw Failed("make the directory " + part, path);
    if (at == std::string::npos) break;
  }
}

}  // namespace

MetricsLog MetricsLog::Open(const std::string& path, int64_t start_step) {
  MakeParent(path);
  MetricsLog log;
  log.path_ = path;
  // The lines of the steps up to start_step; the file is rewritten only when some are dropped.
  std::ifstream in(path);
  if (in) {
    std::string kept, line;
    bool dropped = false;
    while (std::getline(in, line)) {
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (j.is_object() && j.contains("step") && j["step"].is_number_integer() &&
          j["step"].get<int64_t>() <= start_step) {
        kept += line + "\n";
        ++log.kept_lines_;
      } else {
        dropped = true;
      }
    }
    in.close();
    if (dropped) WriteFileAtomically(path, kept);
  }
  log.file_.reset(std::fopen(path.c_str(), "a"));
  if (!log.file_) throw Failed("open it for appending", path);
  return log;
}

void MetricsLog::Write(const nlohmann::json& record) {
  // dump() writes NaN and infinities as null.
  const std::string line = record.dump() + "\n";
  if (std::fwrite(line.data(), 1, line.size(), file_.get()) != line.size() ||
      std::fflush(file_.get()) != 0) {
    throw Failed("write", path_);
  }
}

}  // namespace vlmgraph::train
