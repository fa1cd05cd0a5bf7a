#pragma once
// Log lines on stderr, one format for all of them:
//   2026-12-07T01:02:03.456Z I serve: listening on http://127.0.0.1:8080 (...)
// the UTC time to the millisecond, a level letter (E error, W warning, I information, D debug) and
// the text. A request's lines start with its id ("chatcmpl-..." or "cmpl-..."). --log-verbosity N
// prints the levels up to N: 0 none, 1 errors, 2 and warnings, 3 and information (the default),
// 4 and debug.
#include <chrono>
#include <string>

namespace microspec::log {

enum class Level { Error = 1, Warning = 2, Info = 3, Debug = 4 };
constexpr int kDefaultVerbosity = 3;
constexpr int kMaxVerbosity = 4;

// Sets the highest level printed (0..kMaxVerbosity); throws Error outside that range.
void set_verbosity(int verbosity);
bool enabled(Level level);

// "2026-12-07T01:02:03.456Z I ": the start of a line logged at `time`.
std::string line_prefix(std::chrono::system_clock::time_point time, Level level);

// printf-style text after the prefix; the whole line (newline added) goes out in one write, so the
// lines of concurrent threads do not interleave.
void error(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void warning(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void info(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void debug(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

}  // namespace microspec::log
