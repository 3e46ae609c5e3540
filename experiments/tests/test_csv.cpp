// The tidy CSV table and the atomic writes behind every output file.
#include <doctest/doctest.h>

#include <cmath>
#include <fstream>

#include "atomic_file.hpp"
#include "csv.hpp"
#include "scratch_dir.hpp"

using namespace linrope::experiments;
using linrope::experiments::testing::count_temporaries;
using linrope::experiments::testing::ScratchDir;

TEST_CASE("format_number is exact for integers and keys, and names the non-finite values") {
  CHECK(format_number(linrope::Index(1048576)) == "1048576");
  CHECK(format_number(500000.0) == "500000");
  CHECK(format_number(0.1) == "0.1");
  CHECK(format_number(1.0 / 3) == "0.333333333");
  CHECK(format_number(NAN) == "nan");
  CHECK(format_number(-INFINITY) == "-inf");
}

TEST_CASE("split_csv_line handles quotes") {
  CHECK(split_csv_line("a,b,,c") == std::vector<std::string>{"a", "b", "", "c"});
  CHECK(split_csv_line("\"x,y\",\"say \"\"hi\"\"\",z\r") ==
        std::vector<std::string>{"x,y", "say \"hi\"", "z"});
}

TEST_CASE("CsvTable: rows by column name, keys, save and load round trip") {
  ScratchDir dir("csv");
  CsvTable table({"method", "n", "time_ms"}, 2);
  table.add(Row().set("method", "linear").set("n", linrope::Index(256)).set("time_ms", 1.5));
  table.add(Row().set("n", linrope::Index(512)).set("time_ms", 3.25).set("method", "a,b"));
  CHECK(table.size() == 2);
  CHECK(table.contains({"linear", "256"}));
  CHECK(table.number(1, "time_ms") == 3.25);
  CHECK(table.text(1, "method") == "a,b");
  // Same key: replaced, not duplicated.
  table.add(Row().set("method", "linear").set("n", linrope::Index(256)).set("time_ms", 2.0));
  CHECK(table.size() == 2);
  CHECK(table.number(0, "time_ms") == 2.0);

  const auto path = dir.path() / "t.csv";
  table.save(path);
  CHECK(read_file(path) == "method,n,time_ms\nlinear,256,2\n\"a,b\",512,3.25\n");
  CHECK(count_temporaries(dir.path()) == 0);

  CsvTable again({"method", "n", "time_ms"}, 2);
  CHECK(again.load(path) == 2);
  CHECK(again.to_csv() == table.to_csv());
  CHECK(again.load(dir.path() / "absent.csv") == 0);
}

TEST_CASE("CsvTable rejects incomplete rows, unknown columns and a foreign header") {
  ScratchDir dir("csv-bad");
  CsvTable table({"a", "b"}, 1);
  CHECK_THROWS_WITH_AS(table.add(Row().set("a", "1")), doctest::Contains("'b'"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(table.add(Row().set("a", "1").set("b", "2").set("c", "3")),
                       doctest::Contains("'c', which is not a column"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(table.key_of(Row().set("b", "2")), doctest::Contains("key column 'a'"),
                       std::invalid_argument);
  CHECK_THROWS_AS(CsvTable({"a", "a"}, 1), std::invalid_argument);
  CHECK_THROWS_AS(table.number(0, "a"), std::out_of_range);

  write_file_atomic(dir.path() / "old.csv", "a,b,c\n1,2,3\n");
  CHECK_THROWS_WITH_AS(table.load(dir.path() / "old.csv"), doctest::Contains("header"),
                       std::runtime_error);
  write_file_atomic(dir.path() / "short.csv", "a,b\n1\n");
  CHECK_THROWS_WITH_AS(table.load(dir.path() / "short.csv"), doctest::Contains(":2 has 1 fields"),
                       std::runtime_error);
}

TEST_CASE("write_file_atomic replaces whole files and leaves no temporary behind") {
  ScratchDir dir("atomic");
  const auto path = dir.path() / "sub" / "file.json";
  write_file_atomic(path, "first");
  write_file_atomic(path, "second, longer");
  CHECK(read_file(path) == "second, longer");
  CHECK(count_temporaries(dir.path()) == 0);
  CHECK(temporary_path_for(path).parent_path() == path.parent_path());  // same filesystem

  SUBCASE("a failed write throws and leaves nothing") {
    std::ofstream(dir.path() / "plain") << "x";
    CHECK_THROWS(write_file_atomic(dir.path() / "plain" / "child.csv", "data"));
    CHECK(count_temporaries(dir.path()) == 0);
  }
  SUBCASE("leftovers of a killed run are removed") {
    std::ofstream(dir.path() / ".scaling.csv.tmp-999") << "partial";
    std::ofstream(dir.path() / "keep.csv") << "kept";
    CHECK(remove_stale_temporaries(dir.path()) == 1);
    CHECK(count_temporaries(dir.path()) == 0);
    CHECK(std::filesystem::exists(dir.path() / "keep.csv"));
  }
}
