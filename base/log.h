// base/log.h: the project's logger: one-line, timestamped messages on stderr, filtered by the
// server config's log_level. In the lowest layer, so the model, the engine, the trainer and the
// server all log through it.
//
//   SetLogLevel("info");
//   LogInfo("listening on " + address);
//   LogDebug("Generate " + LogSafe(request.request_id()) + " from " + peer);
//
// Text a client chose (request ids, error messages that echo input) goes through LogSafe, so it
// cannot forge log lines or make one line megabytes long.
//
// Thread rules: safe from any thread (one write per line).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace vlmgraph {

enum class LogLevel { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

// "error", "warn", "info", "debug"; anything else keeps the current level.
void SetLogLevel(const std::string& level);
bool LogEnabled(LogLevel level);
void Log(LogLevel level, const std::string& message);

inline void LogError(const std::string& m) { Log(LogLevel::kError, m); }
inline void LogWarn(const std::string& m) { Log(LogLevel::kWarn, m); }
inline void LogInfo(const std::string& m) { Log(LogLevel::kInfo, m); }
inline void LogDebug(const std::string& m) { Log(LogLevel::kDebug, m); }

// printf-style formatting for log messages: LogInfo(LogFormat("%zu graphs in %.2f s", n, s)).
std::string LogFormat(const char* format, ...) __attribute__((format(printf, 1, 2)));

// `text` made safe for one log line: its first `max_bytes` bytes (cut back to a UTF-8 character
// boundary) with '\n', '\r' and '\t' written as those two-character escapes, a backslash
// doubled, and every other control byte (< 0x20, 0x7f) as \xNN; UTF-8 text is kept as it is.
// Longer text ends with "...(N bytes)", N being its whole size. The result holds at most
// 4 * max_bytes + 32 bytes and no byte below 0x20.
//   LogSafe("a\nb") == "a\\nb";  LogSafe(std::string(1000, 'x'), 4) == "xxxx...(1000 bytes)"
std::string LogSafe(std::string_view text, size_t max_bytes = 128);

}  // namespace vlmgraph
