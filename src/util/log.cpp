#include "util/log.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <ctime>

#include "util/error.h"

namespace microspec::log {

namespace {

std::atomic<int> g_verbosity{kDefaultVerbosity};

char level_letter(Level level) {
  switch (level) {
    case Level::Error: return 'E';
    case Level::Warning: return 'W';
    case Level::Info: return 'I';
    case Level::Debug: return 'D';
  }
  return '?';
}

void write_line(Level level, const char* fmt, va_list args) {
  if (!enabled(level)) return;
  std::string line = line_prefix(std::chrono::system_clock::now(), level);
  va_list measure;
  va_copy(measure, args);
  const int n = std::vsnprintf(nullptr, 0, fmt, measure);
  va_end(measure);
  const size_t start = line.size();
  line.resize(start + size_t(std::max(n, 0)) + 1);
  std::vsnprintf(line.data() + start, size_t(std::max(n, 0)) + 1, fmt, args);
  line.back() = '\n';  // over vsnprintf's terminating zero
  std::fflush(stderr);  // whatever the process printed through stdio before goes out first
  for (size_t done = 0; done < line.size();) {
    const ssize_t w = ::write(STDERR_FILENO, line.data() + done, line.size() - done);
    if (w <= 0) return;  // stderr closed: the log is lost, the server goes on
    done += size_t(w);
  }
}

}  // namespace

void set_verbosity(int verbosity) {
  if (verbosity < 0 || verbosity > kMaxVerbosity)
    throw Error("--log-verbosity must be in [0, " + std::to_string(kMaxVerbosity) + "], got " +
                std::to_string(verbosity));
  g_verbosity = verbosity;
}

bool enabled(Level level) {
  return int(level) <= g_verbosity.load(std::memory_order_relaxed);
}

std::string line_prefix(std::chrono::system_clock::time_point time, Level level) {
  using namespace std::chrono;
  const auto since_epoch = duration_cast<milliseconds>(time.time_since_epoch());
  const std::time_t seconds = std::time_t(floor<std::chrono::seconds>(since_epoch).count());
  const int millis = int(since_epoch.count() - int64_t(seconds) * 1000);
  std::tm utc{};
  gmtime_r(&seconds, &utc);
  char buf[40];
  const size_t n = std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S", &utc);
  std::snprintf(buf + n, sizeof buf - n, ".%03dZ %c ", millis, level_letter(level));
  return buf;
}

#define MICROSPEC_LOG_AT(name, level)           \
  void name(const char* fmt, ...) {             \
    va_list args;                               \
    va_start(args, fmt);                        \
    write_line(level, fmt, args);               \
    va_end(args);                               \
  }
MICROSPEC_LOG_AT(error, Level::Error)
MICROSPEC_LOG_AT(warning, Level::Warning)
MICROSPEC_LOG_AT(info, Level::Info)
MICROSPEC_LOG_AT(debug, Level::Debug)
#undef MICROSPEC_LOG_AT

}  // namespace microspec::log
