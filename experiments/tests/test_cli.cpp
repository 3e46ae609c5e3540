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
      {{"--bogus", "rope-decay"}, "unknown option --bogus"},
      {{"rope-decay", "--bogus"}, "unknown option --bogus"},
      {{}, "subcommand"},
      {{"nonsense"}, "unknown subcommand 'nonsense'"},
      {{"scaling", "--lengths", "256,abc"}, "abc"},
      {{"scaling", "--lengths", "256,0"}, "--lengths: '0' is not a number > 0"},
      {{"rope-decay", "--quick", "--full"}, "--quick"},
      {{"rope-decay", "--decay-dim", "7"}, "--decay-dim: 7 is odd"},
      {{"rope-decay", "--threads", "-2"}, "--threads: '-2' is not a number >= 0"},
      {{"scaling", "--heads", "0"}, "--heads: '0' is not a number > 0"},
      {{"scaling", "--one-head-n", "-2"}, "--one-head-n: '-2' is not an integer >= -1"},
      {{"favor-error", "--favor-scales", "0.5,-1"}, "--favor-scales: '-1' is not a number > 0"},
      {{"normalization", "--norm-threshold", "-1e-3"},
       "--norm-threshold: '-1e-3' is not a number >= 0"},
      {{"scaling", "--causal-methods", "scan,fast"},
       "--causal-methods: fast not in {scan,chunked}"},
      {{"rope-decay", "--out"}, "--out"},
      {{"rope-decay", "scaling"}, "scaling"},
      // Options belong to their subcommand: one of another is an error, not ignored.
      {{"rope-decay", "--lengths", "5"}, "--lengths is an option of scaling, not of rope-decay"},
      {{"scaling", "--decay-dim=16"}, "--decay-dim is an option of rope-decay, not of scaling"},
      {{"all", "--norm-seeds", "2"},
       "--norm-seeds is an option of normalization, not of all (which runs every experiment with "
       "its defaults)"},
      {{"--lengths", "5", "scaling"}, "--lengths is an option of scaling: put it after"},
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
  CHECK(r.out.find("--lengths") == std::string::npos);  // scaling's, listed by `scaling --help`
  CHECK(r.err.empty());
  const Result scaling = run({"scaling", "--help"});
  CHECK(scaling.status == 0);
  CHECK(scaling.out.find("--lengths") != std::string::npos);
  CHECK(scaling.out.find("--decay-dim") == std::string::npos);
}
