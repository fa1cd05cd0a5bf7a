// The log line format (util/log.h): UTC time to the millisecond and a level letter, and the
// verbosity's range and levels.
#include <gtest/gtest.h>

#include <chrono>

#include "util/error.h"
#include "util/log.h"

namespace microspec {
namespace {

TEST(Log, LinePrefixIsUtcTimeToTheMillisecondAndALevelLetter) {
  using namespace std::chrono;
  const system_clock::time_point t{milliseconds(int64_t(1796605323456))};  // 2026-12-07T01:02:03.456Z
  EXPECT_EQ(log::line_prefix(t, log::Level::Info), "2026-12-07T01:02:03.456Z I ");
  EXPECT_EQ(log::line_prefix(t + milliseconds(544), log::Level::Error), "2026-12-07T01:02:04.000Z E ");
  EXPECT_EQ(log::line_prefix(system_clock::time_point{}, log::Level::Warning), "1970-01-01T00:00:00.000Z W ");
  EXPECT_EQ(log::line_prefix(t, log::Level::Debug).substr(24), " D ");
}

TEST(Log, VerbosityPrintsTheLevelsUpToIt) {
  log::set_verbosity(2);
  EXPECT_TRUE(log::enabled(log::Level::Error));
  EXPECT_TRUE(log::enabled(log::Level::Warning));
  EXPECT_FALSE(log::enabled(log::Level::Info));
  log::set_verbosity(0);
  EXPECT_FALSE(log::enabled(log::Level::Error));
  log::set_verbosity(4);
  EXPECT_TRUE(log::enabled(log::Level::Debug));
  EXPECT_THROW(log::set_verbosity(5), Error);
  EXPECT_THROW(log::set_verbosity(-1), Error);
  log::set_verbosity(log::kDefaultVerbosity);
  EXPECT_TRUE(log::enabled(log::Level::Info));
  EXPECT_FALSE(log::enabled(log::Level::Debug));
}

}  // namespace
}  // namespace microspec
