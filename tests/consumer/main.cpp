// Built against an installed linrope: exits 0 only if RoPE keeps the norm of a row.
#include <cmath>
#include <cstdio>
#include <linrope/linrope.hpp>

int main() {
  linrope::Rope rope({.dim = 8});
  linrope::MatrixD x = linrope::MatrixD::Ones(3, 8);
  const double before = x.norm();
  rope.apply(x, 5);
  const bool ok = std::abs(x.norm() - before) < 1e-12;
  std::printf("consumer: |R x| = %.15f, |x| = %.15f -> %s\n", x.norm(), before, ok ? "ok" : "FAIL");
  return ok ? 0 : 1;
}
