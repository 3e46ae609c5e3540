// RoPE (include/linrope/rope.hpp, src/rope.cpp) against explicit rotation matrices
// (tests/reference/rope_reference.hpp), worked numbers for every scaling, the properties every
// suite checks, float accuracy at large positions, the decay curve, and bad input.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <linrope/rope.hpp>
#include <numbers>
#include <span>
#include <string>
#include <vector>

#include "reference/random.hpp"
#include "reference/rope_reference.hpp"
#include "rope/rope_access.hpp"

namespace {

using namespace linrope;

const char* layout_name(RopeLayout l) {
  return l == RopeLayout::Interleaved ? "interleaved" : "half";
}

std::string scaling_name(const RopeScaling& s) {
  switch (s.kind) {
    case RopeScalingKind::None:
      return "none";
    case RopeScalingKind::Linear:
      return "linear s=" + std::to_string(s.factor);
    case RopeScalingKind::Ntk:
      return "ntk s=" + std::to_string(s.factor);
    case RopeScalingKind::Yarn:
      return "yarn s=" + std::to_string(s.factor) + " L=" + std::to_string(s.original_max_position);
  }
  return "?";
}

// Unit roundoff of T: 2^-24 for float, 2^-53 for double.
template <class T>
constexpr double unit_roundoff() {
  return std::numeric_limits<T>::epsilon() / 2;
}
constexpr double kUd = unit_roundoff<double>();

double max_abs_position(const std::vector<Index>& positions) {
  double m = 0;
  for (Index p : positions) m = std::max(m, std::abs(double(p)));
  return m;
}

// Bound on |library - reference| for one output element y = g (a cos - b sin) of a row whose
// entries are at most max_abs_x, rotated by the double-precision angle p theta:
//  - in T: cos and sin (magnitude folded in) to within 4 u_T g: the AVX-512 float kernel joins
//    the block centre's C = g cos(h theta) and S, each rounded to float, with the table's
//    c = cos(l theta) and s, also rounded, by one float angle addition fma(C, c, -S s):
//    2 u_T |C c| + 3 u_T |S s| + u_T g for the last rounding, with |C c| + |S s| <= g
//    (elsewhere they are rounded once from double, u_T g). Then one product and one fused
//    difference:
//    (4 + 1 + 1) u_T g (|a| + |b|);
//  - in double: the angle p theta is off by ~2 u_d |p| theta_max (theta from pow versus exp/log,
//    then the product; the table split and the mirroring of p < 0 only re-associate it), plus
//    ~6 u_d for the table entries, the angle addition, the magnitude and the reference's own
//    rounding;
//  - |a| + |b| <= 2 max_abs_x;  4x margin on top.
template <class T>
double rope_tolerance(const RopeConfig& c, double max_abs_x, double max_abs_p) {
  const std::vector<double> theta = reference::frequencies(c);
  const double theta_max = *std::max_element(theta.begin(), theta.end());
  const double g = reference::magnitude(c);
  return 4 * g * 2 * max_abs_x *
         (6 * unit_roundoff<T>() + 6 * kUd + 2 * kUd * max_abs_p * theta_max);
}

// x (double, N(0,1)) converted to T: the reference then rotates exactly the values the library saw.
template <class T>
Matrix<T> input(Index rows, Index cols, std::uint64_t seed) {
  return testing::gaussian(rows, cols, seed).cast<T>();
}

// Applies the library (offset form when positions are consecutive from `first`, list form
// otherwise) and compares with the explicit matrices; also checks that the pass-through columns
// are untouched bit for bit.
template <class T>
void check_against_matrices(const RopeConfig& c, const Matrix<T>& x0,
                            const std::vector<Index>& positions, bool use_list, bool inverse) {
  const Rope rope(c);
  Matrix<T> x = x0;
  if (use_list) {
    inverse ? rope.apply_inverse(x, std::span<const Index>(positions))
            : rope.apply(x, std::span<const Index>(positions));
  } else {
    inverse ? rope.apply_inverse(x, positions.empty() ? 0 : positions.front())
            : rope.apply(x, positions.empty() ? 0 : positions.front());
  }
  const MatrixD expected = reference::apply(c, x0.template cast<double>(), positions, inverse);
  const double err = (x.template cast<double>() - expected).cwiseAbs().maxCoeff();
  const double tol = rope_tolerance<T>(c, x0.template cast<double>().cwiseAbs().maxCoeff(),
                                       max_abs_position(positions));
  // The inverse divides by the magnitude g >= 1 instead of multiplying: the bound above, which
  // carries g, still covers it.
  CAPTURE(err);
  CAPTURE(tol);
  CHECK(err <= tol);
  const Index r = reference::rotary_width(c);
  CHECK(x.rightCols(c.dim - r) == x0.rightCols(c.dim - r));
}

struct Width {
  Index dim, rotary;
};
// Rotary width = dim from 2 to 130, then rotary widths below dim (odd dims included). r/2 = 16, 32
// and 64 take src/rope.cpp's unrolled kernels, the other widths its generic one; r/2 = 25 has
// all three parts of the AVX-512 float kernel (16 pairs in float, 8 in double, then one).
const std::vector<Width> kWidths = {{2, 2},   {4, 4},   {6, 6},     {8, 8},     {10, 10}, {50, 50},
                                    {64, 64}, {66, 66}, {128, 128}, {130, 130}, {3, 2},   {9, 4},
                                    {66, 64}, {65, 32}, {130, 128}, {128, 2}};
const std::vector<Index> kRows = {1, 3, 7, 65, 129};
const std::vector<RopeLayout> kLayouts = {RopeLayout::Interleaved, RopeLayout::Half};

// The scalings swept everywhere. Yarn with L = 4096 puts pairs of every kind (kept, ramped,
// interpolated) in all but the narrowest widths: for dim 8, theta = 1, 0.1, 0.01, 0.001 make
// 652, 65, 6.5, 0.65 turns over 4096 positions.
const std::vector<RopeScaling> kScalings = {
    {},
    {.kind = RopeScalingKind::Linear, .factor = 4},
    {.kind = RopeScalingKind::Linear, .factor = 0.5},
    {.kind = RopeScalingKind::Ntk, .factor = 8},
    {.kind = RopeScalingKind::Yarn, .factor = 8, .original_max_position = 4096},
    {.kind = RopeScalingKind::Yarn,
     .factor = 16,
     .original_max_position = 64,
     .beta_fast = 16,
     .beta_slow = 2},
};

// One case of a sweep: the rope (dim, rotary width, layout, scaling; the base at its default), and
// the rows and the first position of its input where the sweep sets them (-1 and 0 otherwise).
struct RopeCase {
  RopeConfig config;
  Index rows = -1, first = 0;
};

// What a test sweeps. An empty list is not swept: no scaling, or the RopeCase defaults.
struct RopeSweep {
  std::vector<RopeScaling> scalings = {};
  std::vector<RopeLayout> layouts = kLayouts;
  std::vector<Width> widths = {};
  std::vector<Index> rows = {}, firsts = {};
};

// Calls fn(const RopeCase&) for every scaling x layout x width x row count x first position, in
// that order (the tests that draw a seed per case depend on it), with the case CAPTUREd.
template <class Fn>
void for_each_rope_case(const RopeSweep& sweep, Fn&& fn) {
  const auto or_default = [](const auto& list, auto value) {
    return list.empty() ? std::vector<decltype(value)>{value} : list;
  };
  for (const RopeScaling& s : or_default(sweep.scalings, RopeScaling{}))
    for (const RopeLayout layout : sweep.layouts)
      for (const Width& w : sweep.widths)
        for (const Index rows : or_default(sweep.rows, Index(-1)))
          for (const Index first : or_default(sweep.firsts, Index(0))) {
            std::string where = "scaling " + scaling_name(s) + ", " + layout_name(layout) +
                                ", dim " + std::to_string(w.dim) + ", rotary " +
                                std::to_string(w.rotary);
            if (!sweep.rows.empty()) where += ", rows " + std::to_string(rows);
            if (!sweep.firsts.empty()) where += ", first " + std::to_string(first);
            CAPTURE(where);
            fn(RopeCase{
                .config = {.dim = w.dim, .rotary_dim = w.rotary, .layout = layout, .scaling = s},
                .rows = rows,
                .first = first});
          }
}

}  // namespace

TEST_CASE_TEMPLATE("Rope::apply matches explicit rotation matrices: widths x rows x offsets", T,
                   float, double) {
  // src/rope.cpp splits |p| into blocks of B = 16 or 32 positions with table levels at multiples of
  // B, B^2 and B^3 (and turns negative positions by -|p| theta), so the offsets put runs across
  // such boundaries: 0; 62 and -66, so that 3 rows cross a multiple of 16 and 64 from either sign,
  // and 65 or 129 rows cross 0; 250 (7 rows cross 256); 4094 (3 rows cross 4096); 2^20 - 2 (3 rows
  // cross 2^20, a multiple of every level, at a large angle). The next test case crosses every
  // level for both block sizes.
  const std::vector<Index> offsets = {0, 62, -66, 250, 4094, (1 << 20) - 2};
  std::uint64_t seed = 1;
  for_each_rope_case({.widths = kWidths, .rows = kRows, .firsts = offsets}, [&](const RopeCase& e) {
    // The last three offsets only on widths <= 10 and up to 7 rows: the boundaries are the same
    // for every width, and the reference costs dim^2 per row.
    if (e.first > 100 && (e.config.dim > 10 || e.rows > 7)) return;
    check_against_matrices<T>(e.config, input<T>(e.rows, e.config.dim, ++seed),
                              reference::consecutive(e.rows, e.first), false, false);
  });
}

TEST_CASE_TEMPLATE("Rope::apply matches explicit rotation matrices for every scaling", T, float,
                   double) {
  const std::vector<Width> widths = {{8, 8}, {10, 6}, {66, 64}, {128, 128}, {131, 128}};
  std::uint64_t seed = 100;
  const RopeSweep sweep{
      .scalings = kScalings, .widths = widths, .rows = {7, 65}, .firsts = {-66, 4090}};
  for_each_rope_case(sweep, [&](const RopeCase& e) {
    const RopeConfig& c = e.config;
    // The frequencies and magnitude themselves: pow versus exp/log in long double differ by a few
    // ulps (4 u_d relative, 4x margin -> 16 u_d).
    const Rope rope(c);
    const std::vector<double> got = rope.frequencies(), want = reference::frequencies(c);
    REQUIRE(got.size() == want.size());
    for (std::size_t i = 0; i < got.size(); ++i) {
      CAPTURE(i);
      CHECK(std::abs(got[i] - want[i]) <= 16 * kUd * want[i]);
    }
    CHECK(std::abs(rope.magnitude() - reference::magnitude(c)) <= 4 * kUd);
    check_against_matrices<T>(c, input<T>(e.rows, c.dim, ++seed),
                              reference::consecutive(e.rows, e.first), false, false);
    check_against_matrices<T>(c, input<T>(e.rows, c.dim, ++seed),
                              reference::consecutive(e.rows, e.first), false, true);
  });
}

TEST_CASE_TEMPLATE("explicit position lists match explicit rotation matrices", T, float, double) {
  // Unsorted, repeated, negative, on and around multiples of 16, 64 and 4096 and the edges of
  // src/rope.cpp's 16-row blocks (centre +- 8), and up to 10^6.
  std::vector<Index> positions = {0,       63,      64,  -64, -65,  7,    7,    8,     -8,  24,
                                  1000000, -999999, 128, 1,   4095, 4096, 4104, -4105, 255, 256};
  testing::Gaussian g(7);
  while (positions.size() < 129) positions.push_back(Index(std::floor((g.uniform() - 0.5) * 2e5)));
  const Index rows = Index(positions.size());
  std::uint64_t seed = 200;
  const RopeSweep sweep{.scalings = kScalings, .widths = {{10, 10}, {66, 64}, {129, 128}}};
  for_each_rope_case(sweep, [&](const RopeCase& e) {
    const RopeConfig& c = e.config;
    check_against_matrices<T>(c, input<T>(rows, c.dim, ++seed), positions, true, false);
    check_against_matrices<T>(c, input<T>(rows, c.dim, ++seed), positions, true, true);
  });
}

TEST_CASE_TEMPLATE("position-list apply equals per-row offset apply", T, float, double) {
  const std::vector<Index> positions = {5, -1, -64, 63, 64, 12345678, -7, 0, 100, 99, 1 << 20};
  const Index rows = Index(positions.size());
  for_each_rope_case({.scalings = kScalings, .widths = {{67, 64}}}, [&](const RopeCase& e) {
    const Rope rope(e.config);
    const Matrix<T> x0 = input<T>(rows, 67, 300);
    for (bool inverse : {false, true}) {
      CAPTURE(inverse);
      Matrix<T> listed = x0, by_row = x0;
      if (inverse)
        rope.apply_inverse(listed, std::span<const Index>(positions));
      else
        rope.apply(listed, std::span<const Index>(positions));
      for (Index i = 0; i < rows; ++i) {
        Eigen::Ref<Matrix<T>> row = by_row.middleRows(i, 1);
        inverse ? rope.apply_inverse(row, positions[i]) : rope.apply(row, positions[i]);
      }
      // Both forms reach the same angle through the same double arithmetic; allow a few
      // roundings in T in case one path is reorganised: 8 u_T relative to the row's scale.
      const double scale = x0.template cast<double>().cwiseAbs().maxCoeff() * rope.magnitude();
      CHECK((listed - by_row).template cast<double>().cwiseAbs().maxCoeff() <=
            8 * unit_roundoff<T>() * scale);
    }
    // Consecutive positions in list form equal the offset form.
    const std::vector<Index> run = reference::consecutive(rows, -30);
    Matrix<T> listed = x0, offset = x0;
    rope.apply(listed, std::span<const Index>(run));
    rope.apply(offset, -30);
    CHECK((listed - offset).template cast<double>().cwiseAbs().maxCoeff() <=
          8 * unit_roundoff<T>() * x0.template cast<double>().cwiseAbs().maxCoeff() *
              rope.magnitude());
  });
}

TEST_CASE("apply on a strided view rotates only the view, and rotate_rows takes a stride") {
  // The rope is 12 wide; the matrix is 20 wide: leftCols(12) has outer stride 20.
  const RopeConfig c{.dim = 12, .rotary_dim = 10, .layout = RopeLayout::Half};
  const Rope rope(c);
  const MatrixD x0 = testing::gaussian(9, 20, 400);
  MatrixD x = x0;
  rope.apply(x.block(2, 0, 5, 12), 61);
  const MatrixD expected =
      reference::apply(c, x0.block(2, 0, 5, 12), reference::consecutive(5, 61));
  const double tol = rope_tolerance<double>(c, x0.cwiseAbs().maxCoeff(), 66);
  CHECK((x.block(2, 0, 5, 12) - expected).cwiseAbs().maxCoeff() <= tol);
  CHECK(x.rightCols(8) == x0.rightCols(8));  // columns outside the view: untouched
  CHECK(x.topRows(2) == x0.topRows(2));      // rows outside the view: untouched
  CHECK(x.bottomRows(2) == x0.bottomRows(2));

  // The raw-pointer kernel entry point on the same layout, forward then inverse.
  MatrixF xf = x0.cast<float>();
  const MatrixF xf0 = xf;
  detail::RopeAccess::rotate_rows(rope, xf.data() + 2 * 20, 5, 20, 61, detail::Turn::Apply);
  const MatrixD expected_f =
      reference::apply(c, xf0.block(2, 0, 5, 12).cast<double>(), reference::consecutive(5, 61));
  CHECK((xf.block(2, 0, 5, 12).cast<double>() - expected_f).cwiseAbs().maxCoeff() <=
        rope_tolerance<float>(c, x0.cwiseAbs().maxCoeff(), 66));
  CHECK(xf.rightCols(8) == xf0.rightCols(8));
  detail::RopeAccess::rotate_rows(rope, xf.data() + 2 * 20, 5, 20, 61, detail::Turn::Inverse);
  // Forward then inverse: two tolerances' worth.
  CHECK((xf - xf0).cast<double>().cwiseAbs().maxCoeff() <=
        2 * rope_tolerance<float>(c, x0.cwiseAbs().maxCoeff(), 66));
}

TEST_CASE("rotate_rows over a 16 MB span (the prefetching path) matches the matrices") {
  // 65 rows of width 10 spaced 2^16 floats apart span 16.3 MB: src/rope.cpp then prefetches each
  // next block's rows, in both directions from position -40.
  const Index rows = 65, dim = 10, stride = Index(1) << 16;
  const RopeConfig c{.dim = dim, .rotary_dim = 8, .layout = RopeLayout::Interleaved};
  const Rope rope(c);
  std::vector<float> buffer(std::size_t(rows * stride), 0.0f);
  const MatrixF x0 = input<float>(rows, dim, 900);
  for (Index i = 0; i < rows; ++i)
    for (Index j = 0; j < dim; ++j) buffer[std::size_t(i * stride + j)] = x0(i, j);
  detail::RopeAccess::rotate_rows(rope, buffer.data(), rows, stride, -40, detail::Turn::Apply);
  MatrixD got(rows, dim);
  for (Index i = 0; i < rows; ++i)
    for (Index j = 0; j < dim; ++j) got(i, j) = buffer[std::size_t(i * stride + j)];
  const MatrixD expected =
      reference::apply(c, x0.cast<double>(), reference::consecutive(rows, -40));
  CHECK((got - expected).cwiseAbs().maxCoeff() <=
        rope_tolerance<float>(c, x0.cast<double>().cwiseAbs().maxCoeff(), 40));
  CHECK(buffer[std::size_t(stride + dim)] == 0.0f);  // the gap between rows: untouched
}

TEST_CASE_TEMPLATE("out-of-place rotate_rows is bitwise the in-place rotation of a copy", T, float,
                   double) {
  // Every kernel (fixed widths 16 .. 128, the runtime width, vectors and tails), both layouts,
  // partial rotation (the unrotated columns must be copied), rows on both sides of 0, R, R^-1 and
  // R^T; the
  // source must stay as it was. The linear kernels rotate eq. 19's features this way.
  for (const RopeLayout layout : {RopeLayout::Interleaved, RopeLayout::Half})
    for (const Index dim : {2, 10, 32, 50, 64, 66, 128, 256, 258, 260})
      for (const Index rotary : {dim, dim - 2})
        for (const detail::Turn turn :
             {detail::Turn::Apply, detail::Turn::Inverse, detail::Turn::Transpose}) {
          if (rotary < 2) continue;
          CAPTURE(layout_name(layout));
          CAPTURE(dim);
          CAPTURE(rotary);
          CAPTURE(static_cast<int>(turn));
          const Rope rope({.dim = dim, .rotary_dim = rotary, .layout = layout});
          const Index rows = 37, stride = dim + 3;  // a padded stride; the padding stays untouched
          Matrix<T> from = Matrix<T>::Constant(rows, stride, T(-5));
          from.leftCols(dim) = input<T>(rows, dim, 1000 + std::uint64_t(dim));
          const Matrix<T> original = from;
          Matrix<T> expected = from;  // the copy, rotated in place
          detail::RopeAccess::rotate_rows(rope, expected.data(), rows, stride, -18, turn);
          Matrix<T> to = Matrix<T>::Constant(rows, stride, T(7));
          detail::RopeAccess::rotate_rows<T>(rope, from.data(), to.data(), rows, stride, -18, turn);
          CHECK(to.leftCols(dim) == expected.leftCols(dim));
          CHECK((to.rightCols(3).array() == T(7)).all());
          CHECK(from == original);
        }
}

TEST_CASE_TEMPLATE("runs across every table boundary of both block sizes", T, float, double) {
  // src/rope.cpp uses blocks of B = 32 rows for r/2 <= 32 (<= 64 with AVX-512) and B = 16 above,
  // with table levels at multiples of B, B^2 and B^3: 40-row runs centred on each of +-16, 32,
  // 256, 1024, 4096 and 32768, and on 0, cross them all for either B, from both signs, in the
  // unrolled (r/2 = 32, 64, 128) and the generic (r/2 = 5, 33) kernels.
  std::vector<Index> firsts = {-20};
  for (Index b : {16, 32, 256, 1024, 4096, 32768}) {
    firsts.push_back(b - 20);
    firsts.push_back(-b - 20);
  }
  std::uint64_t seed = 1000;
  const RopeSweep sweep{.widths = {{10, 10}, {64, 64}, {67, 66}, {128, 128}, {256, 256}},
                        .firsts = firsts};
  for_each_rope_case(sweep, [&](const RopeCase& e) {
    for (bool inverse : {false, true}) {
      CAPTURE(inverse);
      check_against_matrices<T>(e.config, input<T>(40, e.config.dim, ++seed),
                                reference::consecutive(40, e.first), false, inverse);
    }
  });
}

TEST_CASE_TEMPLATE("a long run crosses every table level and 0 in both directions", T, float,
                   double) {
  // 10001 consecutive rows from -5000 to 5000: every block and 1024-row boundary on both sides of 0
  // (B = 32 for these widths), and the sign change, in one call; narrow widths keep the dim^2
  // reference cheap.
  const Index rows = 10001, first = -5000;
  std::uint64_t seed = 800;
  const RopeSweep sweep{
      .scalings = {{.kind = RopeScalingKind::Yarn, .factor = 4, .original_max_position = 512}},
      .widths = {{4, 4}, {7, 6}}};
  for_each_rope_case(sweep, [&](const RopeCase& e) {
    for (bool inverse : {false, true}) {
      CAPTURE(inverse);
      check_against_matrices<T>(e.config, input<T>(rows, e.config.dim, ++seed),
                                reference::consecutive(rows, first), false, inverse);
    }
  });
}

TEST_CASE_TEMPLATE("ropes and table tops interleaved: each call gets its own angles", T, float,
                   double) {
  // src/rope.cpp remembers cos/sin(top theta) per thread for the last 4 (frequencies, top), top
  // being |p| rounded down to a multiple of B^3 (4096 for r/2 = 128). Short calls alternate here
  // between four ropes of the same width but different frequencies (and one narrower) and between
  // tops 4096, 8192, 69632 and 2^20, on both signs, so that entries are hit, missed and evicted; a
  // cache that mixed up ropes or tops would rotate by another rope's angles.
  const std::vector<RopeConfig> configs = {
      {.dim = 256},
      {.dim = 256, .base = 500.0},
      {.dim = 256, .scaling = {.kind = RopeScalingKind::Linear, .factor = 4}},
      {.dim = 256, .layout = RopeLayout::Half},
      {.dim = 128}};
  const std::vector<Index> firsts = {5000, 9000, 70000, -5000, 5001, (1 << 20) + 3};
  std::uint64_t seed = 1500;
  for (int round = 0; round < 2; ++round)
    for (Index first : firsts)
      for (std::size_t i = 0; i < configs.size(); ++i) {
        CAPTURE(round);
        CAPTURE(first);
        CAPTURE(i);
        check_against_matrices<T>(configs[i], input<T>(2, configs[i].dim, ++seed),
                                  reference::consecutive(2, first), false, round == 1);
      }
}

TEST_CASE_TEMPLATE("every r/2 from 1 to 41, and 57: float groups of 16, double 8s, scalar tails", T,
                   float, double) {
  // With AVX-512, src/rope.cpp rotates float rows 16 pairs at a time (angle additions in float),
  // then at most one 8-pair vector and the last r/2 mod 8 pairs one by one (both in double):
  // r/2 = 1..41 gives the tail only (< 8), one 8-pair vector (8..15), 16-pair groups alone (16,
  // 32), followed by an 8-pair vector (24, 40), and all of these with every tail length; 57 has
  // three 16-pair groups, an 8-pair vector and a tail, with B = 32. Odd dims leave a pass-through
  // column after the rotated ones. 37 rows
  // from -18 cross 0 in both directions, so each width meets paired rows (h +- l), unpaired block
  // edges and both signs of the angle; forward and inverse, with Yarn so the magnitude is folded
  // in. Double (portable kernel only) runs the same sweep.
  std::uint64_t seed = 3000;
  RopeSweep sweep{
      .scalings = {{.kind = RopeScalingKind::Yarn, .factor = 4, .original_max_position = 256}}};
  for (Index half = 1; half <= 57; half += half < 41 ? 1 : 16)
    sweep.widths.push_back({2 * half + half % 2, 2 * half});
  for_each_rope_case(sweep, [&](const RopeCase& e) {
    for (bool inverse : {false, true}) {
      CAPTURE(inverse);
      check_against_matrices<T>(e.config, input<T>(37, e.config.dim, ++seed),
                                reference::consecutive(37, -18), false, inverse);
    }
  });
}

TEST_CASE_TEMPLATE("r/2 = 64, 128 (unrolled) and 129, 130 (angle buffers on the heap)", T, float,
                   double) {
  // src/rope.cpp keeps its six per-call angle buffers inside the Rotator up to r/2 = 128 (the
  // m = 256 features of linear attention) and on the heap above; r/2 = 64 and 128 take its
  // unrolled AVX-512 kernels. A few rows at a large offset, both layouts.
  std::uint64_t seed = 3500;
  RopeSweep sweep;
  for (Index half : {64, 128, 129, 130}) sweep.widths.push_back({2 * half + 1, 2 * half});
  for_each_rope_case(sweep, [&](const RopeCase& e) {
    check_against_matrices<T>(e.config, input<T>(11, e.config.dim, ++seed),
                              reference::consecutive(11, 100000 - 5), false, false);
  });
}

TEST_CASE("worked numbers for the scalings") {
  SUBCASE("none: theta_i = base^(-2i/r)") {
    // r = 8, base 10000: theta = 10000^(-i/4) = 1, 0.1, 0.01, 0.001.
    const std::vector<double> t = Rope({.dim = 8}).frequencies();
    REQUIRE(t.size() == 4);
    CHECK(t[0] == 1.0);
    CHECK(t[1] == doctest::Approx(0.1).epsilon(1e-14));
    CHECK(t[2] == doctest::Approx(0.01).epsilon(1e-14));
    CHECK(t[3] == doctest::Approx(0.001).epsilon(1e-14));
  }
  SUBCASE("linear s = 4: theta_i / 4") {
    const std::vector<double> t =
        Rope({.dim = 8, .scaling = {.kind = RopeScalingKind::Linear, .factor = 4}}).frequencies();
    REQUIRE(t.size() == 4);
    CHECK(t[0] == 0.25);
    CHECK(t[1] == doctest::Approx(0.025).epsilon(1e-14));
    CHECK(t[2] == doctest::Approx(0.0025).epsilon(1e-14));
    CHECK(t[3] == doctest::Approx(0.00025).epsilon(1e-14));
  }
  SUBCASE("ntk: base' = base * s^(r/(r-2))") {
    // r = 4, s = 4: base' = 10000 * 4^(4/2) = 160000, theta_1 = 160000^(-2/4) = 1/400.
    const std::vector<double> t4 =
        Rope({.dim = 4, .scaling = {.kind = RopeScalingKind::Ntk, .factor = 4}}).frequencies();
    REQUIRE(t4.size() == 2);
    CHECK(t4[0] == 1.0);
    CHECK(t4[1] == doctest::Approx(0.0025).epsilon(1e-14));
    // r = 8, s = 8: base' = 10000 * 8^(8/6) = 10000 * 16 = 160000, so theta_1 = 160000^(-1/4) =
    // 1/20, theta_3 = 160000^(-3/4) = 1/8000 -- the lowest frequency is exactly theta_3 / s
    // (0.001 / 8), which is what NTK-aware scaling is designed to do.
    const std::vector<double> t8 =
        Rope({.dim = 8, .scaling = {.kind = RopeScalingKind::Ntk, .factor = 8}}).frequencies();
    REQUIRE(t8.size() == 4);
    CHECK(t8[0] == 1.0);
    CHECK(t8[1] == doctest::Approx(0.05).epsilon(1e-14));
    CHECK(t8[2] == doctest::Approx(1.0 / 400).epsilon(1e-14));
    CHECK(t8[3] == doctest::Approx(1.0 / 8000).epsilon(1e-14));
  }
  SUBCASE("yarn: L = 4096, s = 8, beta_fast = 32, beta_slow = 1, dim 128") {
    // theta_i = 10000^(-i/64); turns rho_i = 4096 theta_i / (2 pi) = 651.899 * 10^(-i/16).
    //   kept (rho >= 32, gamma = 1):       10^(-i/16) >= 0.049088  <=>  i <= 20
    //     i = 20: rho = 651.899 * 10^-1.25   = 36.659           -> theta' = theta
    //   ramped (1 < rho < 32):             i = 21 .. 45
    //     i = 21: rho = 31.745, gamma = 30.745 / 31 = 0.991785
    //     i = 32: theta = 10^-2 = 0.01, rho = 40.96 / (2 pi) = 6.518986,
    //             gamma = 5.518986 / 31 = 0.178032,
    //             theta' = 0.01 (1 - 0.178032) / 8 + 0.01 * 0.178032 = 0.00280778
    //     i = 45: rho = 1.003876, gamma = 0.000125
    //   interpolated (rho <= 1, gamma = 0): i >= 46 (rho_46 = 0.869), theta' = theta / 8
    // magnitude = 0.1 ln 8 + 1 = 1.2079442.
    const Rope rope(
        {.dim = 128,
         .scaling = {.kind = RopeScalingKind::Yarn, .factor = 8, .original_max_position = 4096}});
    const std::vector<double> t = rope.frequencies();
    REQUIRE(t.size() == 64);
    auto plain = [](int i) { return std::pow(10.0, -i / 16.0); };
    for (int i = 0; i <= 20; ++i) {
      CAPTURE(i);
      CHECK(t[i] == doctest::Approx(plain(i)).epsilon(1e-14));
    }
    for (int i = 46; i < 64; ++i) {
      CAPTURE(i);
      CHECK(t[i] == doctest::Approx(plain(i) / 8).epsilon(1e-14));
    }
    for (int i = 21; i <= 45; ++i) {  // strictly between the two
      CAPTURE(i);
      CHECK(t[i] < plain(i) * (1 - 1e-6));
      CHECK(t[i] > plain(i) / 8 * (1 + 1e-6));
    }
    CHECK(t[32] == doctest::Approx(0.00280778).epsilon(1e-6));  // 6 digits from the hand sum
    CHECK(t[32] == doctest::Approx(0.002807778438843074).epsilon(1e-13));  // same, to 16 digits
    CHECK(t[21] == doctest::Approx(0.048346730768454305).epsilon(1e-13));
    CHECK(rope.magnitude() == doctest::Approx(0.1 * std::log(8.0) + 1).epsilon(1e-15));
    CHECK(rope.magnitude() == doctest::Approx(1.2079442).epsilon(1e-7));
    // Scaled up: the magnitude multiplies the rotated part only.
    MatrixD x = MatrixD::Ones(1, 128);
    rope.apply(x, 0);  // angle 0: pure magnitude
    CHECK((x.array() - rope.magnitude()).abs().maxCoeff() <= 4 * kUd);
  }
  SUBCASE("yarn with s <= 1 keeps magnitude 1") {
    const Rope rope(
        {.dim = 8,
         .scaling = {.kind = RopeScalingKind::Yarn, .factor = 0.5, .original_max_position = 64}});
    CHECK(rope.magnitude() == 1.0);
  }
  SUBCASE("one rotation by hand") {
    // Interleaved, dim 4, position 2: pair 0 turns by 2 rad, pair 1 by 2 * 0.01 rad.
    // x = (1, 0, 0, 1) -> (cos 2, sin 2, -sin 0.02, cos 0.02).
    MatrixD x(1, 4);
    x << 1, 0, 0, 1;
    Rope({.dim = 4, .base = 10000}).apply(x, 2);
    CHECK(x(0, 0) == doctest::Approx(std::cos(2.0)).epsilon(1e-15));
    CHECK(x(0, 1) == doctest::Approx(std::sin(2.0)).epsilon(1e-15));
    CHECK(x(0, 2) == doctest::Approx(-std::sin(0.02)).epsilon(1e-15));
    CHECK(x(0, 3) == doctest::Approx(std::cos(0.02)).epsilon(1e-15));
    // Half layout, same x: pairs are (0, 2) and (1, 3), so (x0, x2) = (1, 0) turns by 2 rad and
    // (x1, x3) = (0, 1) by 0.02 rad -> (cos 2, -sin 0.02, sin 2, cos 0.02).
    MatrixD y(1, 4);
    y << 1, 0, 0, 1;
    Rope({.dim = 4, .layout = RopeLayout::Half}).apply(y, 2);
    CHECK(y(0, 0) == doctest::Approx(std::cos(2.0)).epsilon(1e-15));
    CHECK(y(0, 1) == doctest::Approx(-std::sin(0.02)).epsilon(1e-15));
    CHECK(y(0, 2) == doctest::Approx(std::sin(2.0)).epsilon(1e-15));
    CHECK(y(0, 3) == doctest::Approx(std::cos(0.02)).epsilon(1e-15));
  }
}

TEST_CASE("<R_m q, R_n k> depends on m - n only, and |R_m x| = |x|") {
  // Pairs (m, n) with the same difference d = m - n must give the same logit as (d, 0).
  const std::vector<Index> anchors = {0, 1, 63, 64, -65, 4096, 1000000, 10000019, -10000000};
  const std::vector<Index> diffs = {0, 3, -37, 64, 1000};
  for_each_rope_case({.scalings = kScalings, .widths = {{67, 64}}}, [&](const RopeCase& e) {
    const RopeScaling& s = e.config.scaling;
    const Rope rope(e.config);
    const double g = rope.magnitude();
    const MatrixD q0 = testing::gaussian(1, 67, 500), k0 = testing::gaussian(1, 67, 501);
    const double qn = q0.norm(), kn = k0.norm();
    auto rotated = [&](const MatrixD& x, Index p) {
      MatrixD y = x;
      rope.apply(y, p);
      return y;
    };
    for (Index diff : diffs) {
      const double base_logit = rotated(q0, diff).row(0).dot(rotated(k0, 0).row(0));
      for (Index n : anchors) {
        const Index m = n + diff;
        CAPTURE(m);
        CAPTURE(n);
        const double logit = rotated(q0, m).row(0).dot(rotated(k0, n).row(0));
        // Each rotated vector is off by <= |x| g (2 u_d |p| theta_max + 9 u_d) (see
        // rope_tolerance; theta_max <= 1 here), so a logit by |q| |k| g^2 times the sum for both
        // vectors of both logits; 4x margin.
        const double tol =
            4 * qn * kn * g * g *
            (2 * kUd * double(std::abs(m) + std::abs(n) + std::abs(diff)) + 40 * kUd);
        CHECK(std::abs(logit - base_logit) <= tol);
      }
    }
    // Norms: the rotated part scales by g, the pass-through part is unchanged.
    for (Index p : anchors) {
      CAPTURE(p);
      const MatrixD y = rotated(q0, p);
      CHECK(std::abs(y.leftCols(64).norm() - g * q0.leftCols(64).norm()) <= 16 * kUd * g * qn);
      CHECK(y.rightCols(3) == q0.rightCols(3));
      if (s.kind != RopeScalingKind::Yarn) CHECK(std::abs(y.norm() - qn) <= 16 * kUd * qn);
    }
  });
}

TEST_CASE_TEMPLATE("apply_inverse undoes apply", T, float, double) {
  const RopeSweep sweep{
      .scalings = kScalings, .widths = {{35, 32}}, .firsts = {-100, 0, 61, 10000000}};
  for_each_rope_case(sweep, [&](const RopeCase& e) {
    const RopeConfig& c = e.config;
    const Index first = e.first;
    const Rope rope(c);
    const Matrix<T> x0 = input<T>(65, 35, 600);
    Matrix<T> x = x0;
    rope.apply(x, first);
    rope.apply_inverse(x, first);
    // R^-1 R x: the forward error (rope_tolerance, scaled by g) and the inverse one
    // (rope_tolerance again, divided by g) add up; both in terms of max |x|. The angle term
    // cancels (the same angle both ways), but the bound keeps it.
    const double tol = 2 * rope_tolerance<T>(c, x0.template cast<double>().cwiseAbs().maxCoeff(),
                                             double(std::abs(first) + 65));
    CHECK((x - x0).template cast<double>().cwiseAbs().maxCoeff() <= tol);
    // And the list form.
    const std::vector<Index> positions = reference::consecutive(65, first);
    rope.apply(x, std::span<const Index>(positions));
    rope.apply_inverse(x, std::span<const Index>(positions));
    CHECK((x - x0).template cast<double>().cwiseAbs().maxCoeff() <= 2 * tol);
  });
}

// R^T, the gradient of apply (docs/DESIGN.md, "Gradients"): a rotation by -p theta_i times the
// magnitude g. Checked three ways: against the transpose of the explicit reference matrix, through
// the adjoint identity <R x, y> == <x, R^T y> with the library's own apply, and against
// apply_inverse (bitwise the same when g == 1, g^2 times it under Yarn with s > 1).

namespace {
// The scalings of kScalings plus Yarn with s = 0.5 (magnitude exactly 1 although it is Yarn).
std::vector<RopeScaling> transpose_scalings() {
  std::vector<RopeScaling> s = kScalings;
  s.push_back({.kind = RopeScalingKind::Yarn, .factor = 0.5, .original_max_position = 256});
  return s;
}
}  // namespace

TEST_CASE_TEMPLATE("Rope::apply_transpose is the transpose of the explicit rotation matrix", T,
                   float, double) {
  // The reference builds R(p)^T from R(p) (a transposed matrix, not R(-p)), so a sign or a
  // magnitude mistake in the reverse turn shows as an O(1) error. Per element the library's error
  // is bounded as for apply (rope_tolerance: the same cos, sin and magnitude, the opposite sign
  // of sin). Widths: full and partial rotary (dim 35, r = 32; dim 9, r = 4); positions on both
  // sides of 0 and runs that cross it.
  int counter = 0;
  for_each_rope_case(
      {.scalings = transpose_scalings(),
       .widths = {{8, 8}, {9, 4}, {35, 32}, {66, 64}},
       .firsts = {-100, -3, 0, 61, 10000000}},
      [&](const RopeCase& e) {
        const RopeConfig& c = e.config;
        const Index first = e.first;
        const Rope rope(c);
        const Index rows = 7;
        const Matrix<T> x0 = input<T>(rows, c.dim, 900 + std::uint64_t(counter++));
        const MatrixD xd = x0.template cast<double>();
        // Positions as consecutive offsets (the offset overload) and as a list with jumps, both
        // signs and repeats (the positions overload).
        const std::vector<Index> run = reference::consecutive(rows, first);
        const std::vector<Index> list = {first, -first - 7, 0, 3, 3, -1, first / 2 + 5};
        for (const bool use_list : {false, true}) {
          CAPTURE(use_list);
          const std::vector<Index>& positions = use_list ? list : run;
          Matrix<T> x = x0;
          if (use_list) {
            rope.apply_transpose(x, std::span<const Index>(positions));
          } else {
            rope.apply_transpose(x, first);
          }
          MatrixD expected(rows, c.dim);
          for (Index i = 0; i < rows; ++i)
            expected.row(i) =
                (reference::rotation_matrix(c, (long double)positions[std::size_t(i)]).transpose() *
                 xd.row(i).transpose())
                    .transpose();
          const double err = (x.template cast<double>() - expected).cwiseAbs().maxCoeff();
          const double tol =
              rope_tolerance<T>(c, xd.cwiseAbs().maxCoeff(), max_abs_position(positions));
          CAPTURE(err);
          CAPTURE(tol);
          CHECK(err <= tol);
          CHECK(x.rightCols(c.dim - c.rotary_dim) == x0.rightCols(c.dim - c.rotary_dim));
        }
      });
}

TEST_CASE_TEMPLATE("<R x, y> == <x, R^T y> for every scaling, layout, partial width and position",
                   T, float, double) {
  // Both sides in the library: R x by apply, R^T y by apply_transpose, the inner products of the
  // rounded T results taken in double. Each rotated element errs by at most rope_tolerance (in
  // terms of the largest input entry), so
  //   |<R x, y> - <x, R^T y>| <= tol(x) sum|y| + tol(y) sum|x| + (rows dim) u_d sum|R x||y|,
  // with |R x| <= 2 g max|x| element-wise for the last (double summation) term. A wrong sign in
  // the reverse turn, a missing or inverted magnitude (1/g instead of g under Yarn) or a pair
  // mix-up breaks the identity at O(1).
  int counter = 0;
  for_each_rope_case(
      {.scalings = transpose_scalings(),
       .widths = {{8, 8}, {9, 4}, {35, 32}, {130, 128}},
       .firsts = {-1000003, -65, -2, 0, 17, 4094}},
      [&](const RopeCase& e) {
        const std::uint64_t seed = 2000 + 2 * std::uint64_t(counter++);
        const RopeConfig& c = e.config;
        const Index first = e.first;
        const Rope rope(c);
        const Index rows = 9;
        const Matrix<T> x0 = input<T>(rows, c.dim, seed), y0 = input<T>(rows, c.dim, seed + 1);
        const MatrixD xd = x0.template cast<double>(), yd = y0.template cast<double>();
        const double g = rope.magnitude();
        const double max_x = xd.cwiseAbs().maxCoeff(), max_y = yd.cwiseAbs().maxCoeff();
        const double sum_x = xd.cwiseAbs().sum(), sum_y = yd.cwiseAbs().sum();
        std::vector<Index> list(rows);
        for (Index i = 0; i < rows; ++i)  // alternating signs around `first`
          list[std::size_t(i)] = (i % 2 == 0 ? first : -first) + 3 * i - 13;
        for (const bool use_list : {false, true}) {
          CAPTURE(use_list);
          const std::vector<Index> positions =
              use_list ? list : reference::consecutive(rows, first);
          Matrix<T> rx = x0, rty = y0;
          if (use_list) {
            rope.apply(rx, std::span<const Index>(positions));
            rope.apply_transpose(rty, std::span<const Index>(positions));
          } else {
            rope.apply(rx, first);
            rope.apply_transpose(rty, first);
          }
          const double lhs = (rx.template cast<double>().array() * yd.array()).sum();
          const double rhs = (xd.array() * rty.template cast<double>().array()).sum();
          const double p_max = max_abs_position(positions);
          const double tol = rope_tolerance<T>(c, max_x, p_max) * sum_y +
                             rope_tolerance<T>(c, max_y, p_max) * sum_x +
                             double(rows * c.dim) * kUd * 2 * g * (max_x * sum_y + max_y * sum_x);
          CAPTURE(lhs);
          CAPTURE(rhs);
          CAPTURE(tol);
          CHECK(std::abs(lhs - rhs) <= tol);
        }
      });
}

TEST_CASE_TEMPLATE("apply_transpose equals apply_inverse bitwise when the magnitude is 1", T, float,
                   double) {
  // With g = 1 both turn by -p theta and multiply by 1 (= 1/g): the same kernel call, the same
  // bits. Under Yarn with s > 1, R^T = g^2 R^-1: the two differ by the factor g^2 = 1.46 (s = 8)
  // or 1.63 (s = 16) on the rotated dimensions, and agree bitwise on the pass-through ones.
  const RopeSweep sweep{
      .scalings = transpose_scalings(), .widths = {{35, 32}}, .firsts = {-70, 0, 61}};
  for_each_rope_case(sweep, [&](const RopeCase& e) {
    const RopeConfig& c = e.config;
    const RopeScaling& s = c.scaling;
    const Index first = e.first;
    const Rope rope(c);
    const Matrix<T> x0 = input<T>(65, 35, 610);
    Matrix<T> transposed = x0, inverted = x0;
    rope.apply_transpose(transposed, first);
    rope.apply_inverse(inverted, first);
    const std::vector<Index> positions = {first, -first, 5, -5, 0};
    Matrix<T> transposed_list = x0.topRows(5), inverted_list = x0.topRows(5);
    rope.apply_transpose(transposed_list, std::span<const Index>(positions));
    rope.apply_inverse(inverted_list, std::span<const Index>(positions));
    CHECK(transposed.rightCols(3) == inverted.rightCols(3));
    const double g = rope.magnitude();
    if (s.kind != RopeScalingKind::Yarn || s.factor <= 1) {
      REQUIRE(g == 1.0);
      CHECK(transposed == inverted);
      CHECK(transposed_list == inverted_list);
    } else {
      REQUIRE(g > 1.2);
      CHECK(transposed != inverted);
      CHECK(transposed_list != inverted_list);
      // R^T y = g^2 R^-1 y: each side is within rope_tolerance (times g for the inverse's
      // 1/g, times g^2 for the scaling) of the exact value, in terms of max |x|.
      const double tol = 2 * g * g *
                         rope_tolerance<T>(c, x0.template cast<double>().cwiseAbs().maxCoeff(),
                                           double(std::abs(first) + 65));
      const MatrixD scaled = g * g * inverted.template cast<double>().leftCols(32);
      CHECK((transposed.template cast<double>().leftCols(32) - scaled).cwiseAbs().maxCoeff() <=
            tol);
      // ... and the difference itself is O(1): (g^2 - 1) times the rotated entries.
      const double diff = (transposed.template cast<double>() - inverted.template cast<double>())
                              .leftCols(32)
                              .cwiseAbs()
                              .maxCoeff();
      CHECK(diff >= 0.1 * (g * g - 1));
    }
  });
}

TEST_CASE("Rope::apply_transpose rejects bad input and names itself") {
  using doctest::Contains;
  const Rope rope({.dim = 8});
  MatrixF f(3, 7);
  MatrixD d(3, 9);
  f.setZero();
  d.setZero();
  CHECK_THROWS_WITH_AS(rope.apply_transpose(f, 0),
                       Contains("Rope::apply_transpose: x is [3 x 7] but the rope has dim = 8"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(rope.apply_transpose(d, -4),
                       Contains("Rope::apply_transpose: x is [3 x 9] but the rope has dim = 8"),
                       std::invalid_argument);
  const std::vector<Index> three = {0, 1, 2}, two = {0, 1};
  CHECK_THROWS_WITH_AS(rope.apply_transpose(f, std::span<const Index>(three)),
                       Contains("Rope::apply_transpose: x is [3 x 7] but the rope has dim = 8"),
                       std::invalid_argument);
  MatrixF good_f = MatrixF::Ones(3, 8);
  MatrixD good_d = MatrixD::Ones(3, 8);
  CHECK_THROWS_WITH_AS(rope.apply_transpose(good_f, std::span<const Index>(two)),
                       Contains("Rope::apply_transpose: positions has 2 entries but x has 3 rows"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(rope.apply_transpose(good_d, std::span<const Index>(two)),
                       Contains("Rope::apply_transpose: positions has 2 entries but x has 3 rows"),
                       std::invalid_argument);
  const Index big = Index(1) << 53;
  CHECK_THROWS_WITH_AS(rope.apply_transpose(good_f, big - 1),
                       Contains("Rope::apply_transpose: first_position is 9007199254740991 with 3 "
                                "rows but expected every position within +-2^53"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(rope.apply_transpose(good_d, -big - 1),
                       Contains("Rope::apply_transpose: first_position is -9007199254740993"),
                       std::invalid_argument);
  const std::vector<Index> far = {0, std::numeric_limits<Index>::min(), 1};
  CHECK_THROWS_WITH_AS(rope.apply_transpose(good_d, std::span<const Index>(far)),
                       Contains("Rope::apply_transpose: positions[1] is -9223372036854775808"),
                       std::invalid_argument);
  // A rejected call leaves x alone; zero rows are accepted.
  CHECK((good_f.array() == 1.0f).all());
  CHECK((good_d.array() == 1.0).all());
  MatrixD empty(0, 8);
  CHECK_NOTHROW(rope.apply_transpose(empty, 3));
  CHECK_NOTHROW(rope.apply_transpose(empty, std::span<const Index>()));
}

TEST_CASE("float at large positions matches double to ~1e-6 relative") {
  // Per element, the float result differs from the exact rotation by at most 6 u_f g (|a| + |b|)
  // (rope_tolerance: cos and sin within 4 u_f g, one rounding per product and one per
  // difference), so <= 6 u_f g sqrt(2) sqrt(2) |(a, b)| = 12 u_f g |(a, b)| per pair and
  // 12 u_f g |x_rot| per row (u_f = 2^-24: 7.2e-7). The angle, in double, is off by
  // ~2 u_d p = 2e-9 rad at p = 10^7: negligible. Tolerance 2x: 1.4e-6 relative per row.
  const double u = unit_roundoff<float>();
  const double rel_tol = 2 * 12 * u;
  const RopeSweep sweep{.widths = {{128, 0}},  // rotary_dim 0: all of dim
                        .firsts = {1000000, 999990, 10000000, -10000019}};
  for_each_rope_case(sweep, [&](const RopeCase& e) {
    const RopeConfig& c = e.config;
    const Index first = e.first;
    const Rope rope(c);
    const MatrixD xd = testing::gaussian(65, 128, 700);
    const MatrixF x0 = xd.cast<float>();
    MatrixF xf = x0;
    rope.apply(xf, first);
    MatrixD x_double = x0.cast<double>();
    rope.apply(x_double, first);
    const MatrixD expected =
        reference::apply(c, x0.cast<double>(), reference::consecutive(65, first));
    double worst_vs_double = 0, worst_vs_reference = 0;
    for (Index i = 0; i < 65; ++i) {
      const double norm = double(x0.row(i).cast<double>().norm());
      worst_vs_double =
          std::max(worst_vs_double, (xf.row(i).cast<double>() - x_double.row(i)).norm() / norm);
      worst_vs_reference =
          std::max(worst_vs_reference, (xf.row(i).cast<double>() - expected.row(i)).norm() / norm);
    }
    CAPTURE(worst_vs_double);
    CAPTURE(worst_vs_reference);
    CHECK(worst_vs_double <= rel_tol);
    CHECK(worst_vs_reference <= rel_tol);

    // The test can fail: angles formed in float (float(p) * float(theta)) are off by up to
    // ulp(10^6)/2 = 0.03 rad, far outside the bound.
    if (c.layout == RopeLayout::Interleaved) {
      const std::vector<double> theta = reference::frequencies(c);
      double worst_naive = 0;
      for (Index i = 0; i < 65; ++i) {
        MatrixD naive = x0.row(i).cast<double>();
        for (Index k = 0; k < 64; ++k) {
          const float angle = float(first + i) * float(theta[k]);
          const double a = naive(0, 2 * k), b = naive(0, 2 * k + 1);
          naive(0, 2 * k) = a * std::cos(angle) - b * std::sin(angle);
          naive(0, 2 * k + 1) = a * std::sin(angle) + b * std::cos(angle);
        }
        worst_naive = std::max(worst_naive, (naive - expected.row(i)).norm() /
                                                double(x0.row(i).cast<double>().norm()));
      }
      CAPTURE(worst_naive);
      CHECK(worst_naive > 1000 * rel_tol);
    }
  });
}

TEST_CASE("rope_decay_curve") {
  SUBCASE("m = 0 is mean_j j = (r/2 + 1) / 2") {
    for (Index dim : {2, 8, 10, 128, 130}) {
      CAPTURE(dim);
      const std::vector<double> curve = rope_decay_curve(dim, 10000.0, 3);
      REQUIRE(curve.size() == 4);
      CHECK(curve[0] == doctest::Approx((double(dim) / 2 + 1) / 2).epsilon(1e-14));
    }
  }
  SUBCASE("matches the slow reference; decays for d = 128, base 10000") {
    const std::vector<double> curve = rope_decay_curve(128, 10000.0, 256);
    REQUIRE(curve.size() == 257);
    const std::vector<double> want =
        reference::decay_curve(reference::frequencies({.dim = 128}), 256);
    // 64 unit phasors summed, 64 moduli averaged: ~64 u_d per partial sum plus the angle
    // (m theta <= 256, 2 u_d m); values <= 32.5. 64 u_d * 32.5 * 4 margin ~ 1e-12 absolute.
    for (Index m = 0; m <= 256; ++m) {
      CAPTURE(m);
      CHECK(std::abs(curve[m] - want[m]) <= 1e-12);
    }
    // The decay: 32.5 at m = 0; 15.8 at 16, 10.1 at 64, 9.27 at 128, 6.54 at 256 (the slow
    // reference, evaluated independently in Python); it oscillates, so check the trend.
    CHECK(curve[0] == doctest::Approx(32.5));
    CHECK(curve[256] < 0.25 * curve[0]);
    CHECK(curve[16] < 0.5 * curve[0]);
    CHECK(curve[256] == doctest::Approx(6.543097322978939).epsilon(1e-10));
    double early = 0, late = 0;
    for (Index m = 0; m < 16; ++m) early += curve[m] / 16;
    for (Index m = 192; m <= 256; ++m) late += curve[m] / 65;
    CHECK(late < 0.5 * early);
    CHECK(*std::max_element(curve.begin() + 1, curve.end()) < curve[0]);
  }
  SUBCASE("the Rope overload uses the scaled frequencies") {
    // Linear s = 4 slows every pair by 4: decay_scaled(4 m) = decay_plain(m).
    const Rope plain({.dim = 64, .base = 500});
    const Rope slow(
        {.dim = 64, .base = 500, .scaling = {.kind = RopeScalingKind::Linear, .factor = 4}});
    const std::vector<double> a = rope_decay_curve(plain, 50), b = rope_decay_curve(slow, 200);
    REQUIRE(a.size() == 51);
    REQUIRE(b.size() == 201);
    for (Index m = 0; m <= 50; ++m) {
      CAPTURE(m);
      CHECK(std::abs(b[4 * m] - a[m]) <= 1e-12);
    }
    // YaRN, partial rotary width: only r/2 = 24 pairs count.
    const RopeConfig c{
        .dim = 50,
        .rotary_dim = 48,
        .layout = RopeLayout::Half,
        .scaling = {.kind = RopeScalingKind::Yarn, .factor = 8, .original_max_position = 512}};
    const std::vector<double> yarn = rope_decay_curve(Rope(c), 100);
    const std::vector<double> want = reference::decay_curve(reference::frequencies(c), 100);
    REQUIRE(yarn.size() == 101);
    CHECK(yarn[0] == doctest::Approx(12.5).epsilon(1e-14));
    for (Index m = 0; m <= 100; ++m) {
      CAPTURE(m);
      CHECK(std::abs(yarn[m] - want[m]) <= 1e-12);
    }
    const std::vector<double> zero = rope_decay_curve(plain, 0);
    REQUIRE(zero.size() == 1);
    CHECK(zero[0] == doctest::Approx(16.5));
  }
}

TEST_CASE("bad input throws std::invalid_argument naming the argument, expected and actual") {
  using doctest::Contains;
  SUBCASE("configuration") {
    CHECK_THROWS_WITH_AS(Rope({.dim = 8, .rotary_dim = 5}),
                         Contains("Rope: rotary_dim is 5 but expected an even number"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(Rope({.dim = 7}), Contains("rotary_dim is 7 but expected an even number"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(Rope({.dim = 7}), Contains("rotary_dim = 0 means dim"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(Rope({.dim = 8, .rotary_dim = -2}), Contains("rotary_dim is -2"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(Rope({.dim = 8, .rotary_dim = 10}),
                         Contains("rotary_dim is 10 but expected rotary_dim <= dim = 8"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(Rope({.dim = 0}), Contains("Rope: dim is 0 but expected dim >= 1"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(Rope({.dim = -3}), Contains("dim is -3 but expected dim >= 1"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(Rope({.dim = 8, .base = 0}),
                         Contains("base is 0 but expected a finite base > 0"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(Rope({.dim = 8, .base = -10000}),
                         Contains("base is -10000 but expected a finite base > 0"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(Rope({.dim = 8, .base = std::nan("")}),
                         Contains("base is nan but expected a finite base > 0"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(Rope({.dim = 8, .base = std::numeric_limits<double>::infinity()}),
                         Contains("base is inf but expected a finite base > 0"),
                         std::invalid_argument);
  }
  SUBCASE("scalings") {
    for (RopeScalingKind kind :
         {RopeScalingKind::Linear, RopeScalingKind::Ntk, RopeScalingKind::Yarn}) {
      CAPTURE(int(kind));
      for (double factor : {0.0, -2.0, std::nan("")}) {
        CAPTURE(factor);
        const RopeScaling s{.kind = kind, .factor = factor, .original_max_position = 4096};
        const std::string actual = std::isnan(factor) ? "nan" : factor == 0 ? "0" : "-2";
        CHECK_THROWS_WITH_AS(
            Rope({.dim = 8, .scaling = s}),
            Contains(("scaling.factor is " + actual + " but expected a finite factor > 0").c_str()),
            std::invalid_argument);
      }
    }
    CHECK_THROWS_WITH_AS(
        Rope({.dim = 8, .rotary_dim = 2, .scaling = {.kind = RopeScalingKind::Ntk, .factor = 2}}),
        Contains("rotary_dim is 2 but Ntk scaling needs rotary_dim > 2"), std::invalid_argument);
    CHECK_NOTHROW(
        Rope({.dim = 8, .rotary_dim = 4, .scaling = {.kind = RopeScalingKind::Ntk, .factor = 2}}));
    CHECK_THROWS_WITH_AS(
        Rope({.dim = 8, .scaling = {.kind = RopeScalingKind::Yarn, .factor = 8}}),
        Contains("scaling.original_max_position is 0 but Yarn needs original_max_position > 0"),
        std::invalid_argument);
    CHECK_THROWS_WITH_AS(
        Rope(
            {.dim = 8,
             .scaling = {.kind = RopeScalingKind::Yarn, .factor = 8, .original_max_position = -5}}),
        Contains("scaling.original_max_position is -5"), std::invalid_argument);
    CHECK_THROWS_WITH_AS(
        Rope({.dim = 8,
              .scaling = {.kind = RopeScalingKind::Yarn,
                          .factor = 8,
                          .original_max_position = 4096,
                          .beta_fast = std::nan("")}}),
        Contains("scaling.beta_fast is nan and beta_slow is 1 but Yarn needs finite beta_fast > "
                 "beta_slow"),
        std::invalid_argument);
    CHECK_THROWS_WITH_AS(Rope({.dim = 8,
                               .scaling = {.kind = RopeScalingKind::Yarn,
                                           .factor = 8,
                                           .original_max_position = 4096,
                                           .beta_slow = std::nan("")}}),
                         Contains("scaling.beta_fast is 32 and beta_slow is nan"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(
        Rope({.dim = 8,
              .scaling = {.kind = RopeScalingKind::Yarn,
                          .factor = 8,
                          .original_max_position = 4096,
                          .beta_fast = 1,
                          .beta_slow = 1}}),
        Contains("scaling.beta_fast is 1 and beta_slow is 1 but Yarn needs finite beta_fast > "
                 "beta_slow"),
        std::invalid_argument);
  }
  SUBCASE("apply shapes") {
    const Rope rope({.dim = 8});
    MatrixF f(3, 7);
    MatrixD d(3, 9);
    f.setZero();
    d.setZero();
    CHECK_THROWS_WITH_AS(rope.apply(f, 0),
                         Contains("Rope::apply: x is [3 x 7] but the rope has dim = 8"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(rope.apply(d, 5),
                         Contains("Rope::apply: x is [3 x 9] but the rope has dim = 8"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(rope.apply_inverse(f, 0),
                         Contains("Rope::apply_inverse: x is [3 x 7] but the rope has dim = 8"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(rope.apply_inverse(d, 0),
                         Contains("Rope::apply_inverse: x is [3 x 9] but the rope has dim = 8"),
                         std::invalid_argument);
    const std::vector<Index> three = {0, 1, 2}, two = {0, 1};
    CHECK_THROWS_WITH_AS(rope.apply(f, std::span<const Index>(three)),
                         Contains("x is [3 x 7] but the rope has dim = 8"), std::invalid_argument);
    CHECK_THROWS_WITH_AS(rope.apply_inverse(d, std::span<const Index>(three)),
                         Contains("x is [3 x 9] but the rope has dim = 8"), std::invalid_argument);
    MatrixF good_f = MatrixF::Ones(3, 8);
    MatrixD good_d = MatrixD::Ones(3, 8);
    CHECK_THROWS_WITH_AS(rope.apply(good_f, std::span<const Index>(two)),
                         Contains("Rope::apply: positions has 2 entries but x has 3 rows"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(rope.apply(good_d, std::span<const Index>(two)),
                         Contains("Rope::apply: positions has 2 entries but x has 3 rows"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(rope.apply_inverse(good_f, std::span<const Index>(two)),
                         Contains("Rope::apply_inverse: positions has 2 entries but x has 3 rows"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(rope.apply_inverse(good_d, std::span<const Index>(two)),
                         Contains("Rope::apply_inverse: positions has 2 entries but x has 3 rows"),
                         std::invalid_argument);
    // Positions beyond +-2^53 (not exact in the double angle p theta).
    const Index big = Index(1) << 53;
    CHECK_THROWS_WITH_AS(rope.apply(good_f, big - 1),
                         Contains("Rope::apply: first_position is 9007199254740991 with 3 rows but "
                                  "expected every position within +-2^53 = 9007199254740992"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(rope.apply_inverse(good_d, -big - 1),
                         Contains("Rope::apply_inverse: first_position is -9007199254740993"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(rope.apply(good_d, std::numeric_limits<Index>::min()),
                         Contains("first_position is -9223372036854775808"), std::invalid_argument);
    const std::vector<Index> far = {0, std::numeric_limits<Index>::min(), 1};
    CHECK_THROWS_WITH_AS(
        rope.apply(good_f, std::span<const Index>(far)),
        Contains("Rope::apply: positions[1] is -9223372036854775808 but expected a "
                 "position within +-2^53"),
        std::invalid_argument);
    // The limits themselves are fine.
    MatrixD edge = MatrixD::Ones(1, 8);
    CHECK_NOTHROW(rope.apply(edge, big));
    CHECK_NOTHROW(rope.apply(edge, -big));
    CHECK(std::abs(edge.norm() - std::sqrt(8.0)) <= 1e-14);
    // A rejected call leaves x alone.
    CHECK((good_f.array() == 1.0f).all());
    CHECK((good_d.array() == 1.0).all());
    // Zero rows: nothing to do, nothing thrown.
    MatrixF empty(0, 8);
    CHECK_NOTHROW(rope.apply(empty, 3));
    CHECK_NOTHROW(rope.apply(empty, std::span<const Index>()));
  }
  SUBCASE("decay curve") {
    CHECK_THROWS_WITH_AS(
        rope_decay_curve(8, 10000.0, -1),
        Contains("rope_decay_curve: max_distance is -1 but expected max_distance >= 0"),
        std::invalid_argument);
    CHECK_THROWS_WITH_AS(rope_decay_curve(7, 10000.0, 4), Contains("rotary_dim is 7"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(rope_decay_curve(8, -1.0, 4), Contains("base is -1"),
                         std::invalid_argument);
  }
}

TEST_CASE("layout and scaling names round-trip and unknown names list the valid ones") {
  const char* layouts[] = {"interleaved", "half"};
  for (int i = 0; i < 2; ++i) {
    CAPTURE(i);
    CHECK(std::string(to_string(static_cast<RopeLayout>(i))) == layouts[i]);
    CHECK(rope_layout_from_string(layouts[i]) == static_cast<RopeLayout>(i));
  }
  const char* scalings[] = {"none", "linear", "ntk", "yarn"};
  for (int i = 0; i < 4; ++i) {
    CAPTURE(i);
    CHECK(std::string(to_string(static_cast<RopeScalingKind>(i))) == scalings[i]);
    CHECK(rope_scaling_kind_from_string(scalings[i]) == static_cast<RopeScalingKind>(i));
  }
  CHECK_THROWS_WITH_AS(rope_layout_from_string("neox"),
                       doctest::Contains("rope_layout_from_string: layout is \"neox\" but expected "
                                         "one of interleaved, half"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(rope_scaling_kind_from_string("NTK"),
                       doctest::Contains("scaling is \"NTK\" but expected one of none, linear, "
                                         "ntk, yarn"),
                       std::invalid_argument);
  CHECK_THROWS_AS(to_string(static_cast<RopeLayout>(2)), std::invalid_argument);
}
