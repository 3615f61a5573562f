#include "server/log.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>

namespace vlmgraph::server {
namespace {

std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};

const char* Name(LogLevel level) {
  switch (level) {
    case LogLevel::kError:
      return "E";
    case LogLevel::kWarn:
      return "W";
    case LogLevel::kInfo:
      return "I";
    case LogLevel::kDebug:
      return "D";
  }
  return "?";
}

}  // namespace

void SetLogLevel(const std::string& level) {
  if (level == "error") g_level = static_cast<int>(LogLevel::kError);
  if (level == "warn") g_level = static_cast<int>(LogLevel::kWarn);
  if (level == "info") g_level = static_cast<int>(LogLevel::kInfo);
  if (level == "debug") g_level = static_cast<int>(LogLevel::kDebug);
}

bool LogEnabled(LogLevel level) { return static_cast<int>(level) <= g_level.load(); }

void Log(LogLevel level, const std::string& message) {
  if (!LogEnabled(level)) return;
  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  const int ms = static_cast<int>(
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char stamp[32];
  std::strftime(stamp, sizeof(stamp), "%Y-%m-%dT%H:%M:%S", &tm);
  std::fprintf(stderr, "%s.%03dZ %s vlmgraph] %s\n", stamp, ms, Name(level), message.c_str());
  std::fflush(stderr);
}

}  // namespace vlmgraph::server
