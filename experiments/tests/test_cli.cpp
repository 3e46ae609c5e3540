// The command line in process: exit status 2 and exactly one line on stderr for every bad option.
#include <doctest/doctest.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

#include "cli.hpp"

using linrope::experiments::run_cli;

namespace {
struct Result {
  int status;
  std::string out, err;
};
Result run(std::vector<const char*> args) {
  args.insert(args.begin(), "linrope-experiments");
  std::ostringstream out, err;
  const int status = run_cli(int(args.size()), args.data(), out, err);
  return {status, out.str(), err.str()};
}
}  // namespace

TEST_CASE("bad command lines: status 2, one line on stderr naming the problem") {
  const std::vector<std::pair<std::vector<const char*>, const char*>> cases = {
      {{"--bogus", "rope-decay"}, "--bogus"},
      {{}, "subcommand"},
      {{"nonsense"}, "unknown subcommand 'nonsense'"},
      {{"scaling", "--lengths", "256,abc"}, "abc"},
      {{"scaling", "--lengths", "256,0"}, "--lengths: '0' is not an integer >= 1"},
      {{"rope-decay", "--quick", "--full"}, "--quick"},
      {{"rope-decay", "--decay-dim", "7"}, "--decay-dim: 7 is odd"},
      {{"rope-decay", "--threads", "-2"}, "--threads: '-2' is not an integer >= 0"},
      {{"rope-decay", "--heads", "0"}, "--heads: '0' is not an integer >= 1"},
      {{"favor-error", "--favor-scales", "0.5,-1"}, "--favor-scales: '-1' is not a number > 0"},
      {{"rope-decay", "--out"}, "--out"},
      {{"rope-decay", "scaling"}, "scaling"},
  };
  for (const auto& [args, expected] : cases) {
    std::string joined;
    for (const char* a : args) joined += std::string(a) + " ";
    CAPTURE(joined);
    const Result r = run(args);
    CHECK(r.status == 2);
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
    CHECK(r.err.rfind("linrope-experiments: ", 0) == 0);
    CHECK(r.err.find(expected) != std::string::npos);
    CHECK(r.out.empty());
  }
}

TEST_CASE("--help prints the usage and exits with 0") {
  const Result r = run({"--help"});
  CHECK(r.status == 0);
  CHECK(r.out.find("scaling") != std::string::npos);
  CHECK(r.out.find("--resume") != std::string::npos);
  CHECK(r.err.empty());
}
