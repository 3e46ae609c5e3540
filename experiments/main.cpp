// linrope-experiments: see cli.hpp and `linrope-experiments --help`.
#include <iostream>

#include "cli.hpp"

int main(int argc, char** argv) {
  return linrope::experiments::run_cli(argc, argv, std::cout, std::cerr);
}
