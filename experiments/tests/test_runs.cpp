// Small sweeps of every experiment through the same runner the program uses: the CSV schema, the
// metadata, resuming after an interruption, and no temporary file left behind. The program writes
// those two files only; what the analysis derives from them (summary.json, plots, REPORT.md) is
// tested by experiments/analysis (test_analysis.py, test_pipeline.py).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <linrope/version.hpp>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "atomic_file.hpp"
#include "csv.hpp"
#include "experiment.hpp"
#include "metadata.hpp"
#include "scratch_dir.hpp"
#include "small_options.hpp"

using namespace linrope::experiments;
using linrope::Index;
using linrope::experiments::testing::count_temporaries;
using linrope::experiments::testing::ScratchDir;
using linrope::experiments::testing::small_options;

namespace {

std::vector<std::string> header_of(const std::filesystem::path& csv) {
  std::istringstream in(read_file(csv));
  std::string line;
  std::getline(in, line);
  return split_csv_line(line);
}

std::size_t rows_of(const std::filesystem::path& csv) {
  std::istringstream in(read_file(csv));
  std::string line;
  std::size_t count = 0;
  while (std::getline(in, line)) count += !line.empty();
  return count - 1;
}

// The published schema of each experiment: parameter columns first, then the measurements.
struct Schema {
  const char* experiment;
  std::vector<std::string> columns;
  std::size_t rows;  // for small_options()
};
const std::vector<Schema>& schemas() {
  static const std::vector<Schema> list = {
      {"scaling",
       {"method", "map", "placement", "causal", "causal_method", "heads", "n", "d", "m", "reps",
        "time_ms", "time_min_ms", "time_max_ms", "peak_rss_mib", "rss_before_mib", "extra_mib",
        "io_mib", "threads"},
       // per n: 2 naive + 2 streaming + 2 maps x 4 placements x 2 causal; one-head: 16
       2 * (4 + 16) + 16},
      {"normalization",
       {"input", "map", "placement", "causal", "n", "seed", "d", "m", "den_min",
        "den_nonpositive_frac", "den_below_frac", "den_threshold", "out_row_norm_mean",
        "exact_row_norm_mean", "rel_error", "rel_error_norope"},
       2 * 2 * 5 * 2 * 3 * 4},  // lengths x seeds x inputs x causal x maps x placements
      {"favor-error",
       {"features", "sampling", "m", "seed", "n", "d", "scale", "pairs", "output_dim", "kernel_mse",
        "kernel_rel_mse", "attn_rel_error"},
       2 * 4 * 2 * 2},  // seeds x variants x m x scales (0.5, 1)
      {"rope-decay",
       {"dim", "base", "scaling", "factor", "distance", "decay", "decay_relative"},
       6 * 9},  // curves x distances 0..8
      {"rope-relative",
       {"precision", "dim", "max_position", "samples", "seed", "max_abs_dev", "max_rel_dev",
        "mean_rel_dev"},
       2 * 3},
  };
  return list;
}

}  // namespace

TEST_CASE("every experiment writes its CSV schema and JSON metadata, and nothing else") {
  for (const auto& schema : schemas()) {
    CAPTURE(schema.experiment);
    ScratchDir dir("schema");
    const Options o = small_options(dir.path());
    const Experiment* e = find_experiment(schema.experiment);
    REQUIRE(e != nullptr);
    const Context c = run_experiment(*e, o);
    const std::string stem = stem_of(e->name);
    const auto csv = dir.path() / stem / (stem + ".csv");
    REQUIRE(std::filesystem::exists(csv));
    CHECK(header_of(csv) == schema.columns);
    CHECK(rows_of(csv) == schema.rows);
    CHECK(c.measured == schema.rows);
    CHECK(c.resumed == 0);

    const auto meta = nlohmann::json::parse(read_file(dir.path() / stem / (stem + ".json")));
    CHECK(meta["experiment"] == schema.experiment);
    CHECK(meta["status"] == "complete");
    CHECK(meta["git_commit"].is_string());
    CHECK(meta["linrope_version"] == linrope::version);  // project(VERSION), written once
    CHECK(!meta["machine"]["cpu"].get<std::string>().empty());
    CHECK(meta["machine"]["cores"].get<unsigned>() >= 1);
    CHECK(meta["compiler"].get<std::string>().find(__VERSION__) != std::string::npos);
    // The build's instruction set and OpenMP (this file is compiled with the same flags).
#ifdef __AVX2__
    CHECK(std::count(meta["isa"].begin(), meta["isa"].end(), "avx2") == 1);
#endif
#ifdef __AVX512F__
    CHECK(meta["isa"][0] == "avx512f");
#endif
#ifdef _OPENMP
    CHECK(meta["openmp"]["enabled"] == true);
    CHECK(meta["openmp"]["version"] == _OPENMP);
    CHECK(meta["openmp"]["threads"].get<int>() >= 1);
#else
    CHECK(meta["openmp"]["enabled"] == false);
#endif
    // A build runs only on a CPU with the extensions it was compiled for.
    for (const auto& extension : meta["isa"]) {
      CAPTURE(extension);
      CHECK(std::count(meta["machine"]["isa"].begin(), meta["machine"]["isa"].end(), extension) ==
            1);
    }
    CHECK(meta["git_dirty"].is_boolean());  // tests run in a git work tree
    CHECK(meta["seeds"].is_array());
    if (std::string(schema.experiment) != "rope-decay")  // the only one without randomness
      CHECK(!meta["seeds"].empty());
    CHECK(meta["options"]["seed"] == 1);
    CHECK(meta["date"].get<std::string>().size() == 20);  // 2024-05-01T12:00:00Z
    CHECK(meta["points_measured"] == schema.rows);

    // The data flow one way: what is derived from these two files is the analysis's to write.
    std::vector<std::string> written;
    for (const auto& entry : std::filesystem::recursive_directory_iterator(dir.path()))
      if (entry.is_regular_file())
        written.push_back(entry.path().lexically_relative(dir.path()).string());
    std::sort(written.begin(), written.end());
    CHECK(written ==
          std::vector<std::string>{stem + "/" + stem + ".csv", stem + "/" + stem + ".json"});
  }
}

TEST_CASE("the numbers obey what the maths guarantees") {
  ScratchDir dir("numbers");
  const Options o = small_options(dir.path());

  SUBCASE("normalization: numerator-only denominators stay positive for non-negative maps") {
    run_experiment(*find_experiment("normalization"), o);
    CsvTable t(header_of(dir.path() / "normalization" / "normalization.csv"), 6);
    t.load(dir.path() / "normalization" / "normalization.csv");
    for (std::size_t r = 0; r < t.size(); ++r) {
      CAPTURE(t.text(r, "input"));
      CAPTURE(t.text(r, "map"));
      CAPTURE(t.text(r, "placement"));
      if (t.text(r, "placement") == "numerator_only" || t.text(r, "placement") == "none") {
        CHECK(t.number(r, "den_nonpositive_frac") == 0);
        CHECK(t.number(r, "den_min") > 0);
      }
      CHECK(std::isfinite(t.number(r, "rel_error")));
      CHECK(t.number(r, "exact_row_norm_mean") > 0);
    }
  }
  SUBCASE("rope-decay: the bound starts at (d/2 + 1) / 2") {
    // At m = 0 every partial sum |sum_{i<j} 1| = j, so the mean over j = 1..d/2 is (d/2 + 1) / 2.
    run_experiment(*find_experiment("rope-decay"), o);
    CsvTable t(header_of(dir.path() / "rope_decay" / "rope_decay.csv"), 5);
    t.load(dir.path() / "rope_decay" / "rope_decay.csv");
    for (std::size_t r = 0; r < t.size(); ++r)
      if (t.number(r, "distance") == 0 && t.text(r, "scaling") != "yarn")
        CHECK(t.number(r, "decay") == doctest::Approx((16 / 2 + 1) / 2.0));
  }
  SUBCASE("rope-relative: double keeps the identity far better than float") {
    run_experiment(*find_experiment("rope-relative"), o);
    CsvTable t(header_of(dir.path() / "rope_relative" / "rope_relative.csv"), 4);
    t.load(dir.path() / "rope_relative" / "rope_relative.csv");
    for (std::size_t r = 0; r < t.size(); ++r) {
      CAPTURE(t.text(r, "max_position"));
      // Float: rotated values rounded to 2^-24 relative, d = 8 terms, a few roundings each:
      // ~1e-6 relative to |q||k|; bound 1e-5. Double: the angle p theta (up to p = max_position)
      // carries an error of ~ulp(p) = p 2^-52, which moves the dot product by as much relative to
      // |q||k|; a few such angles enter (m, n and n - m): bound 16 p 2^-52 + 1e-14.
      const double p = t.number(r, "max_position");
      const double bound = t.text(r, "precision") == "float" ? 1e-5 : 16 * p * 0x1p-52 + 1e-14;
      CHECK(t.number(r, "max_rel_dev") < bound);
    }
  }
  SUBCASE("scaling: times positive; memory measured") {
    run_experiment(*find_experiment("scaling"), o);
    CsvTable t(header_of(dir.path() / "scaling" / "scaling.csv"), 9);
    t.load(dir.path() / "scaling" / "scaling.csv");
    for (std::size_t r = 0; r < t.size(); ++r) {
      CHECK(t.number(r, "time_ms") > 0);
      CHECK(t.number(r, "time_min_ms") <= t.number(r, "time_ms"));
      // Linux (6.2 on) keeps a process's resident-page counts in per-CPU counters and reads them
      // approximately in /proc (each CPU may hold up to 32 pages of a counter's updates, for the
      // anonymous, file and shared-memory counts each): 3 x 32 pages x 4 KiB = 384 KiB per CPU.
      // The peak read after the run fell 48 KiB below the baseline read before it, once, under
      // ASan on 2 CPUs; a real peak below the baseline would be far more than this slack.
      const double slack_mib = 3 * 32 * 4.0 / 1024 * std::thread::hardware_concurrency();
      CHECK(t.number(r, "peak_rss_mib") >= t.number(r, "rss_before_mib") - slack_mib);
      CHECK(t.number(r, "io_mib") == doctest::Approx(4.0 * t.number(r, "heads") * t.number(r, "n") *
                                                     t.number(r, "d") * 4 / (1024.0 * 1024.0)));
    }
    const auto meta = nlohmann::json::parse(read_file(dir.path() / "scaling" / "scaling.json"));
    CHECK(meta["run"]["memory_measured"] == true);
    CHECK(meta["run"]["skipped_points"].empty());
  }
}

TEST_CASE("--resume keeps the rows of an interrupted run and measures only the rest") {
  // An interrupted run leaves a CSV with the first rows only (every save is atomic). Simulate it:
  // a complete run, then the CSV cut to its first rows, whose measured values are replaced by a
  // sentinel that no real measurement produces.
  for (const char* name : {"rope-relative", "scaling", "favor-error"}) {
    CAPTURE(name);
    ScratchDir dir("resume");
    Options o = small_options(dir.path());
    const Experiment& e = *find_experiment(name);
    const std::string stem = stem_of(name);
    const auto csv = dir.path() / stem / (stem + ".csv");
    const std::size_t total = run_experiment(e, o).measured;
    REQUIRE(total >= 4);

    std::vector<std::string> columns = header_of(csv);
    const std::string measured_column = columns.back();  // a measured value in every schema
    CsvTable full(columns, columns.size());              // every column in the key: keep every row
    full.load(csv);
    std::string partial = read_file(csv).substr(0, read_file(csv).find('\n') + 1);
    const std::size_t kept = 3;
    for (std::size_t r = 0; r < kept; ++r) {
      std::vector<std::string> cells = full.row(r);
      cells.back() = "12345";
      for (std::size_t c = 0; c < cells.size(); ++c) partial += (c ? "," : "") + cells[c];
      partial += '\n';
    }
    write_file_atomic(csv, partial);
    // A temporary file from the killed run.
    std::ofstream(dir.path() / stem / ("." + stem + ".csv.tmp-424242")) << "half a row";

    o.resume = true;
    std::size_t measured = 0;
    const Context c = run_experiment(e, o, [&](const std::vector<std::string>&) { ++measured; });
    CHECK(c.resumed == kept);
    CHECK(c.measured == total - kept);
    CHECK(measured == total - kept);

    CsvTable after(columns, columns.size());
    after.load(csv);
    REQUIRE(after.size() == total);
    for (std::size_t r = 0; r < kept; ++r) CHECK(after.row(r).back() == "12345");
    for (std::size_t r = kept; r < total; ++r) CHECK(after.row(r).back() != "12345");
    CHECK(count_temporaries(dir.path()) == 0);
    const auto meta = nlohmann::json::parse(read_file(dir.path() / stem / (stem + ".json")));
    CHECK(meta["points_resumed"] == kept);
  }
}

TEST_CASE("--resume refuses a CSV written with other columns") {
  ScratchDir dir("resume-foreign");
  Options o = small_options(dir.path());
  o.resume = true;
  write_file_atomic(dir.path() / "rope_decay" / "rope_decay.csv", "dim,base\n16,10000\n");
  CHECK_THROWS_WITH_AS(run_experiment(*find_experiment("rope-decay"), o),
                       doctest::Contains("header"), std::runtime_error);
}

TEST_CASE("scaling: the causal method is a column and part of the key, so --resume keeps apart") {
  ScratchDir dir("causal-method");
  Options o = small_options(dir.path());
  const Experiment& e = *find_experiment("scaling");
  const auto csv = dir.path() / "scaling" / "scaling.csv";
  const std::size_t per_method = 2 * 16 + 16;  // causal linear points: 2 lengths + one head
  REQUIRE(o.scaling.causal_methods == std::vector<std::string>{"scan"});
  const std::size_t scan_only = run_experiment(e, o).measured;

  // Chunked added with --resume: the scan rows are kept, and only the chunked points measured.
  o.scaling.causal_methods = {"scan", "chunked"};
  o.resume = true;
  const Context c = run_experiment(e, o);
  CHECK(c.resumed == scan_only);
  CHECK(c.measured == per_method / 2);
  CsvTable t(header_of(csv), 9);
  t.load(csv);
  REQUIRE(t.size() == scan_only + per_method / 2);
  std::map<std::string, std::size_t> count;
  for (std::size_t r = 0; r < t.size(); ++r) {
    const bool causal_linear = t.text(r, "method") == "linear" && t.text(r, "causal") == "1";
    CHECK((t.text(r, "causal_method") != "none") == causal_linear);
    ++count[t.text(r, "causal_method")];
  }
  CHECK(count["scan"] == count["chunked"]);
  CHECK(count["chunked"] == per_method / 2);
}

TEST_CASE("git_dirty: false for a clean work tree, true once a tracked file changes") {
  ScratchDir dir("git");
  const std::string git = "git -C " + shell_quote(dir.path().string()) +
                          " -c user.name=t -c user.email=t@t -c commit.gpgsign=false ";
  int status = 0;
  run_command(git + "init -q", status);
  REQUIRE(status == 0);
  std::ofstream(dir.path() / "file") << "one\n";
  run_command(git + "add file", status);
  run_command(git + "commit -q -m one", status);
  REQUIRE(status == 0);
  CHECK(git_dirty(dir.path().string()) == false);
  std::ofstream(dir.path() / "untracked") << "not tracked\n";
  CHECK(git_dirty(dir.path().string()) == false);
  std::ofstream(dir.path() / "file") << "two\n";
  CHECK(git_dirty(dir.path().string()) == true);
  ScratchDir plain("not-git");
  CHECK_FALSE(git_dirty(plain.path().string()).has_value());
}
