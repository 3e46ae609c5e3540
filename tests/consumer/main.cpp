// Built against an installed linrope: exits 0 only if RoPE keeps the norm of a row. Prints the
// version from <linrope/version.hpp>, which run.cmake compares with the project's.
#include <cmath>
#include <cstdio>
#include <linrope/linrope.hpp>
#include <linrope/version.hpp>

int main() {
  linrope::Rope rope({.dim = 8});
  linrope::MatrixD x = linrope::MatrixD::Ones(3, 8);
  const double before = x.norm();
  rope.apply(x, 5);
  const bool ok = std::abs(x.norm() - before) < 1e-12;
  std::printf("consumer: linrope %s, |R x| = %.15f, |x| = %.15f -> %s\n", linrope::version,
              x.norm(), before, ok ? "ok" : "FAIL");
  return ok ? 0 : 1;
}
