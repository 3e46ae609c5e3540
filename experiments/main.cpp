// linrope-experiments: see cli.hpp and `linrope-experiments --help`.
#include "cli.hpp"

#include <iostream>

int main(int argc, char** argv) {
  return linrope::experiments::run_cli(argc, argv, std::cout, std::cerr);
}
