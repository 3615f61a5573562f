#include "base/log.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <ctime>

namespace vlmgraph {
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

std::string LogFormat(const char* format, ...) {
  va_list args;
  va_start(args, format);
  va_list copy;
  va_copy(copy, args);
  const int n = std::vsnprintf(nullptr, 0, format, copy);
  va_end(copy);
  std::string out(n > 0 ? static_cast<size_t>(n) : 0, '\0');
  if (n > 0) std::vsnprintf(out.data(), out.size() + 1, format, args);
  va_end(args);
  return out;
}

std::string LogSafe(std::string_view text, size_t max_bytes) {
  size_t keep = std::min(text.size(), max_bytes);
  if (keep < text.size()) {  // don't split a UTF-8 character: back off over continuation bytes
    while (keep > 0 && (static_cast<unsigned char>(text[keep]) & 0xC0) == 0x80) --keep;
  }
  std::string out;
  out.reserve(keep + 24);
  for (size_t i = 0; i < keep; ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\\') {
      out += "\\\\";
    } else if (c < 0x20 || c == 0x7f) {
      char hex[5];
      std::snprintf(hex, sizeof(hex), "\\x%02x", c);
      out += hex;
    } else {
      out += static_cast<char>(c);
    }
  }
  if (keep < text.size()) out += "...(" + std::to_string(text.size()) + " bytes)";
  return out;
}

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

}  // namespace vlmgraph
