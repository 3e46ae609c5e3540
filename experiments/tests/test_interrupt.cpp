// Ctrl-C and SIGTERM during a run, through the same run_cli the program uses: the handlers, the
// CSV left behind (exactly the finished points), the exit status and the one line on stderr, the
// metadata of the stopped experiment, and a --resume that ends with the same points as a run that
// was never interrupted. (What the analysis makes of an interrupted run's metadata, a section
// saying so and no figures, is tested in experiments/analysis/test_analysis.py.) Signals are raised
// with std::raise from the on_measure hook, i.e. while a point is being measured, as a Ctrl-C would
// arrive; raise() delivers the signal to the calling thread before it returns, so the point at
// which it lands is deterministic.
#include <doctest/doctest.h>
#include <signal.h>

#include <algorithm>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "atomic_file.hpp"
#include "cli.hpp"
#include "csv.hpp"
#include "interrupt.hpp"
#include "scratch_dir.hpp"
#include "small_options.hpp"
#include "sweep.hpp"

using namespace linrope::experiments;
using linrope::experiments::testing::count_temporaries;
using linrope::experiments::testing::ScratchDir;
using linrope::experiments::testing::small_options;

namespace {

using Hook = std::function<void(const std::vector<std::string>&)>;

struct Result {
  int status;
  std::string out, err;
};

Result run(const std::vector<std::string>& args, Hook on_measure = {}) {
  std::vector<const char*> argv = {"linrope-experiments"};
  for (const auto& a : args) argv.push_back(a.c_str());
  std::ostringstream out, err;
  const int status = run_cli(int(argv.size()), argv.data(), out, err, std::move(on_measure));
  return {status, out.str(), err.str()};
}

// Tiny sizes (those of test_runs.cpp) on the command line, each experiment's own options: every
// run here takes well under a second, a few under the sanitizers.
std::vector<std::string> small_args(const std::filesystem::path& out, const std::string& command) {
  std::vector<std::string> args = {command, "--out", out.string(), "--quiet"};
  const std::map<std::string, std::string> sizes = {
      {"scaling",
       "--lengths 16,32 --heads 2 --dim 8 --reps 1 --naive-max 32 --softmax-max 32 "
       "--scaling-features 8 --one-head-n 64 --fit-min-n 16"},
      {"rope-decay", "--decay-dim 16 --decay-distance 8"}};
  std::istringstream words(sizes.at(command));
  for (std::string word; words >> word;) args.push_back(word);
  return args;
}

Result run_all(const Options& options, Hook on_measure) {
  std::vector<const Experiment*> all;
  for (const auto& e : all_experiments()) all.push_back(&e);
  std::ostringstream out, err;
  const int status = run_experiments(all, options, out, err, std::move(on_measure));
  return {status, out.str(), err.str()};
}

std::size_t lines_of(const std::string& text) {
  return std::size_t(std::count(text.begin(), text.end(), '\n'));
}

// The rows of a CSV (every column, or only the first `columns`), read back through CsvTable, which
// throws on a malformed file: a CSV that loads is a valid one.
std::vector<std::vector<std::string>> rows_of(const std::filesystem::path& csv,
                                              std::size_t columns = 0) {
  std::istringstream in(read_file(csv));
  std::string header;
  std::getline(in, header);
  const std::vector<std::string> names = split_csv_line(header);
  CsvTable table(names, names.size());  // every column in the key: no row can replace another
  table.load(csv);
  std::vector<std::vector<std::string>> rows;
  for (std::size_t r = 0; r < table.size(); ++r) {
    const auto& row = table.row(r);
    rows.emplace_back(row.begin(),
                      columns == 0 ? row.end() : row.begin() + std::ptrdiff_t(columns));
  }
  return rows;
}

nlohmann::json metadata(const std::filesystem::path& out, const std::string& stem) {
  return nlohmann::json::parse(read_file(out / stem / (stem + ".json")));
}

}  // namespace

TEST_CASE("the handlers only record the signal, re-arm the default action, and leave no trace") {
  struct sigaction before_int {
  }, before_term{}, now{};
  sigaction(SIGINT, nullptr, &before_int);
  sigaction(SIGTERM, nullptr, &before_term);
  {
    const InterruptHandlers handlers;
    CHECK_FALSE(interrupted());
    sigaction(SIGINT, nullptr, &now);
    CHECK((now.sa_handler != before_int.sa_handler));
    CHECK((now.sa_handler != SIG_DFL));
    std::raise(SIGINT);
    CHECK(interrupt_signal() == SIGINT);
    // One-shot: a second Ctrl-C now takes the default action (force quit).
    sigaction(SIGINT, nullptr, &now);
    CHECK((now.sa_handler == SIG_DFL));
    sigaction(SIGTERM, nullptr, &now);
    CHECK((now.sa_handler != SIG_DFL));
    CHECK((now.sa_handler != before_term.sa_handler));
  }
  CHECK_FALSE(interrupted());  // a later run starts clean
  sigaction(SIGINT, nullptr, &now);
  CHECK((now.sa_handler == before_int.sa_handler));
  sigaction(SIGTERM, nullptr, &now);
  CHECK((now.sa_handler == before_term.sa_handler));
  {
    const InterruptHandlers handlers;
    std::raise(SIGTERM);
    CHECK(interrupt_signal() == SIGTERM);
    CHECK(signal_name(interrupt_signal()) == "SIGTERM");
  }
  CHECK_FALSE(interrupted());
}

TEST_CASE("a signal ignored when the run starts stays ignored") {
  struct sigaction ignore {
  }, before{}, now{};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  sigaction(SIGINT, &ignore, &before);
  {
    const InterruptHandlers handlers;
    sigaction(SIGINT, nullptr, &now);
    CHECK((now.sa_handler == SIG_IGN));
    std::raise(SIGINT);  // ignored: no flag
    CHECK_FALSE(interrupted());
  }
  sigaction(SIGINT, nullptr, &now);
  CHECK((now.sa_handler == SIG_IGN));
  sigaction(SIGINT, &before, nullptr);
}

// A stand-in for rope-decay (same directory and CSV) whose signal comes before its first point
// finishes, as Ctrl-C during favor-error's or normalization's set-up would.
Outcome interrupted_before_first_point(Context& context) {
  std::raise(SIGINT);
  Sweep sweep(context, "rope_decay",
              {"dim", "base", "scaling", "factor", "distance", "decay", "decay_relative"}, 5, 1,
              1.0);
  Row key;
  key.set("dim", 16).set("base", 77).set("scaling", "none").set("factor", 1).set("distance", 0);
  sweep.begin(key, "point", 1.0);  // throws Interrupted
  FAIL("begin() started a point after the signal");
  return {};
}

TEST_CASE("Ctrl-C before the first point finishes leaves an earlier run's files as they were") {
  const ScratchDir dir("interrupt-first");
  REQUIRE(run(small_args(dir.path(), "rope-decay")).status == 0);
  const std::filesystem::path exp_dir = dir.path() / "rope_decay";
  std::ofstream(exp_dir / "rope_decay.png") << "the earlier analysis's plot";
  const std::vector<std::filesystem::path> files = {
      exp_dir / "rope_decay.csv", exp_dir / "rope_decay.json", exp_dir / "rope_decay.png"};
  std::vector<std::string> before;
  for (const auto& f : files) before.push_back(read_file(f));

  Options options;
  options.out = dir.path();
  options.quiet = true;
  const Experiment stand_in{"rope-decay", "", &interrupted_before_first_point};
  {
    const InterruptHandlers handlers;
    CHECK_THROWS_AS(run_experiment(stand_in, options), Interrupted);
  }
  for (std::size_t i = 0; i < files.size(); ++i) {
    CAPTURE(files[i]);
    CHECK(read_file(files[i]) == before[i]);  // not rewritten: no empty table, no "interrupted"
  }
  CHECK(count_temporaries(dir.path()) == 0);
}

TEST_CASE(
    "Ctrl-C: finished points saved, marked interrupted, status 130, one line, and --resume "
    "completes the run") {
  struct Case {
    const char* experiment;
    std::size_t total;        // points of small_args()
    std::size_t key_columns;  // what identifies a point
    bool deterministic;       // every value reproducible (scaling measures times)
  };
  for (const Case& c :
       {Case{"rope-decay", 6 * 9, 5, true}, Case{"scaling", 2 * (4 + 16) + 16, 9, false}}) {
    for (const std::size_t k : {std::size_t(1), std::size_t(5)}) {
      CAPTURE(c.experiment);
      CAPTURE(k);
      const std::string stem = c.experiment == std::string("rope-decay") ? "rope_decay" : "scaling";
      ScratchDir reference_dir("interrupt-reference"), dir("interrupt");
      const auto csv = dir.path() / stem / (stem + ".csv");
      const std::size_t columns = c.deterministic ? 0 : c.key_columns;

      const Result reference = run(small_args(reference_dir.path(), c.experiment));
      REQUIRE(reference.status == 0);
      const auto expected = rows_of(reference_dir.path() / stem / (stem + ".csv"), columns);
      REQUIRE(expected.size() == c.total);
      // The signal lands while the k-th point is measured: that point finishes and is saved, and
      // no further point starts.
      std::size_t calls = 0;
      const Result stopped = run(small_args(dir.path(), c.experiment), [&](const auto&) {
        if (++calls == k) std::raise(SIGINT);
      });
      CHECK(stopped.status == 130);
      CHECK(calls == k);
      CHECK(lines_of(stopped.err) == 1);
      CHECK(stopped.err == "linrope-experiments: interrupted (SIGINT) during " +
                               std::string(c.experiment) + "; " + std::to_string(k) + " of " +
                               std::to_string(c.total) + " points saved to " + csv.string() +
                               "; run again with --resume to continue\n");
      CHECK_FALSE(interrupted());  // run_cli removed its handlers and cleared the flag

      // Exactly the finished points, in sweep order, and a file that loads.
      const auto partial = rows_of(csv, columns);
      REQUIRE(partial.size() == k);
      CHECK(std::equal(partial.begin(), partial.end(), expected.begin()));
      const auto partial_full = rows_of(csv);
      CHECK(count_temporaries(dir.path()) == 0);

      // Marked incomplete in the metadata, which the analysis reads.
      const auto meta = metadata(dir.path(), stem);
      CHECK(meta["status"] == "interrupted");
      CHECK(meta["signal"] == "SIGINT");
      CHECK(meta["points_measured"] == k);
      CHECK(meta["points_total"] == c.total);
      CHECK(meta["points_saved"] == k);

      // --resume measures only the rest and ends with the points of the uninterrupted run.
      calls = 0;
      auto args = small_args(dir.path(), c.experiment);
      args.push_back("--resume");
      const Result resumed = run(args, [&](const auto&) { ++calls; });
      CHECK(resumed.status == 0);
      CHECK(resumed.err.empty());
      CHECK(calls == c.total - k);
      const auto final_rows = rows_of(csv, columns);
      CHECK(std::set(final_rows.begin(), final_rows.end()) ==
            std::set(expected.begin(), expected.end()));
      CHECK(final_rows.size() == c.total);
      // The resumed rows are kept as they were, measured values included.
      const auto final_full = rows_of(csv);
      CHECK(std::equal(partial_full.begin(), partial_full.end(), final_full.begin()));
      const auto meta_after = metadata(dir.path(), stem);
      CHECK(meta_after["status"] == "complete");
      CHECK(meta_after["points_resumed"] == k);
      CHECK(meta_after["points_measured"] == c.total - k);
      CHECK(count_temporaries(dir.path()) == 0);
    }
  }
}

TEST_CASE(
    "SIGTERM during a run of every experiment: earlier ones complete, later ones not started, "
    "143") {
  ScratchDir dir("interrupt-all");
  // The key of each experiment has its own width: 9 columns for scaling, 6 for normalization.
  constexpr std::size_t kScaling = 9, kNormalization = 6;
  const std::size_t normalization_total = 2 * 2 * 5 * 2 * 3 * 4;  // see test_runs.cpp
  std::size_t scaling_calls = 0, normalization_calls = 0, other_calls = 0;
  auto count = [&](const std::vector<std::string>& key) {
    if (key.size() == kScaling)
      ++scaling_calls;
    else if (key.size() == kNormalization)
      ++normalization_calls;
    else
      ++other_calls;
  };
  Options options = small_options(dir.path());
  const Result stopped = run_all(options, [&](const auto& key) {
    count(key);
    if (key.size() == kNormalization && normalization_calls == 3) std::raise(SIGTERM);
  });
  CHECK(stopped.status == 143);
  CHECK(lines_of(stopped.err) == 1);
  CHECK(stopped.err.find("interrupted (SIGTERM) during normalization; 3 of " +
                         std::to_string(normalization_total) + " points saved to ") !=
        std::string::npos);
  CHECK(stopped.out.find("scaling: ") != std::string::npos);  // finished before the signal
  CHECK(other_calls == 0);
  CHECK(metadata(dir.path(), "scaling")["status"] == "complete");
  CHECK(metadata(dir.path(), "normalization")["status"] == "interrupted");
  CHECK(rows_of(dir.path() / "normalization" / "normalization.csv").size() == 3);
  for (const char* later : {"favor_error", "rope_decay", "rope_relative"})
    CHECK_FALSE(std::filesystem::exists(dir.path() / later));

  const std::size_t scaling_before = scaling_calls;
  scaling_calls = normalization_calls = other_calls = 0;
  options.resume = true;
  const Result resumed = run_all(options, count);
  CHECK(resumed.status == 0);
  CHECK(resumed.err.empty());
  CHECK(scaling_calls == 0);
  CHECK(scaling_before > 0);
  CHECK(normalization_calls == normalization_total - 3);
  CHECK(rows_of(dir.path() / "normalization" / "normalization.csv").size() == normalization_total);
  for (const char* stem :
       {"scaling", "normalization", "favor_error", "rope_decay", "rope_relative"}) {
    CAPTURE(stem);
    CHECK(metadata(dir.path(), stem)["status"] == "complete");
  }
  CHECK(count_temporaries(dir.path()) == 0);
}
