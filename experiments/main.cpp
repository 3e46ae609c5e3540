// linrope-experiments: see cli.hpp and `linrope-experiments --help`.
#include <csignal>
#include <iostream>

#include "cli.hpp"

int main(int argc, char** argv) {
  const int status = linrope::experiments::run_cli(argc, argv, std::cout, std::cerr);
  // Stopped by Ctrl-C or SIGTERM (everything finished is saved by now): end the way a shell
  // expects, killed by that signal, so that a shell loop around the program stops too.
  if (status == 128 + SIGINT || status == 128 + SIGTERM) {
    std::cout.flush();
    std::signal(status - 128, SIG_DFL);
    std::raise(status - 128);
  }
  return status;
}
