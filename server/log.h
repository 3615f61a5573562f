// server/log.h: one-line, timestamped log messages on stderr, filtered by config's log_level.
//
//   SetLogLevel("info");
//   LogInfo("listening on " + address);
//
// Thread rules: safe from any thread (one write per line).
#pragma once

#include <string>

namespace vlmgraph::server {

enum class LogLevel { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

// "error", "warn", "info", "debug"; anything else keeps the current level.
void SetLogLevel(const std::string& level);
bool LogEnabled(LogLevel level);
void Log(LogLevel level, const std::string& message);

inline void LogError(const std::string& m) { Log(LogLevel::kError, m); }
inline void LogWarn(const std::string& m) { Log(LogLevel::kWarn, m); }
inline void LogInfo(const std::string& m) { Log(LogLevel::kInfo, m); }
inline void LogDebug(const std::string& m) { Log(LogLevel::kDebug, m); }

}  // namespace vlmgraph::server
