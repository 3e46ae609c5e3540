#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "progress.hpp"
#include "stats.hpp"

using namespace linrope::experiments;

TEST_CASE("durations for the progress bar") {
  CHECK(Progress::format_duration(0) == "0s");
  CHECK(Progress::format_duration(59.4) == "59s");
  CHECK(Progress::format_duration(59.6) == "1m00s");
  CHECK(Progress::format_duration(185) == "3m05s");
  CHECK(Progress::format_duration(3725) == "1h02m");
  CHECK(Progress::format_duration(NAN) == "?");
  CHECK(Progress::format_duration(-1) == "?");
}

TEST_CASE("statistics of repeated timings") {
  const std::vector<double> x = {3, 1, 2, 10};
  CHECK(median(x) == 2.5);
  CHECK(median(std::vector<double>{5, 1, 3}) == 3);
  CHECK(minimum(x) == 1);
  CHECK(maximum(x) == 10);
  CHECK(std::isnan(median(std::vector<double>{})));
}
