// The compiled half of linear_gradient_cases.hpp: the reference-side pieces every gradient test
// shares (finite differences, the bounds, the problem loop), compiled once for all the tests that
// use them rather than in each (they dominate those tests' build, instrumented builds most).
#include "linear_gradient_cases.hpp"

namespace linrope::testing {

Gradients finite_differences(const Setup& s) {
  constexpr double h = ref::kFiniteDifferenceStep;
  const auto both = [&](const MatrixD& x, const auto& loss, MatrixD& gradient, MatrixD& error) {
    gradient = ref::central_difference(x, loss, h);
    error = (ref::central_difference(x, loss, 2 * h) - gradient).cwiseAbs();
  };
  Gradients g;
  both(
      s.q, [&](const MatrixD& x) { return s.loss(x, s.k, s.v); }, g.dq, g.error_q);
  both(
      s.k, [&](const MatrixD& x) { return s.loss(s.q, x, s.v); }, g.dk, g.error_k);
  both(
      s.v, [&](const MatrixD& x) { return s.loss(s.q, s.k, x); }, g.dv, g.error_v);
  const ref::LinearResult r = s.reference();
  double size = 0;
  for (Index i = 0; i < r.den.size(); ++i) {
    const double den = std::abs(r.den(i) + s.p.eps);
    if (r.admissible[std::size_t(i)] == 0 || den == 0) continue;
    const double o = r.out.cols() > 0 ? r.out.row(i).cwiseAbs().maxCoeff() : 0.0;
    size += s.d_out.row(i).cwiseAbs().sum() *
            (s.p.denominator ? (r.num_magnitude(i) + o * (r.den_magnitude(i) + s.p.eps)) / den
                             : r.num_magnitude(i));
  }
  // A decay's pow(g, p_i - p_j) errs by ~|log g| P u_d, P the span of positions.
  const double decay_terms =
      ref::decay_exponent_size(reference_spec(s.options, s.spec), s.q.rows(), s.k.rows());
  const double rounding =
      4 * (double(s.m + s.p.d + s.k.rows() + 16) + decay_terms) * kUnitDouble * size / h;
  for (MatrixD* e : {&g.error_q, &g.error_k, &g.error_v}) e->array() += rounding;
  return g;
}

MatrixD jacobian_magnitude(FeatureMapKind kind, const MatrixD& w, const MatrixD& x) {
  const Index d = x.cols();
  switch (kind) {
    case FeatureMapKind::EluPlusOne: {
      MatrixD j = MatrixD::Zero(d, d);
      for (Index c = 0; c < d; ++c) j(c, c) = std::exp(std::min(x(0, c), 0.0));
      return j;
    }
    case FeatureMapKind::Relu: {
      MatrixD j = MatrixD::Zero(d, d);
      for (Index c = 0; c < d; ++c) j(c, c) = x(0, c) > 0 ? 1.0 : 0.0;
      return j;
    }
    case FeatureMapKind::OnePlusCosine: {
      MatrixD j = MatrixD::Zero(d + 1, d);
      const double norm = x.norm();
      if (norm == 0) return j;
      for (Index l = 0; l < d; ++l)
        for (Index c = 0; c < d; ++c)
          j(l, c) = ((l == c ? 1.0 : 0.0) + std::abs(x(0, l) * x(0, c)) / (norm * norm)) / norm;
      return j;
    }
    default: {
      const Index f = w.rows();
      const double s = std::pow(double(d), -0.25);
      const ref::FavorRow r = ref::favor_row(w, x, 0);
      const bool two = kind != FeatureMapKind::FavorPositive;
      MatrixD j = MatrixD::Zero(two ? 2 * f : f, d);
      for (Index l = 0; l < f; ++l) {
        double first = 0, second = 0;
        if (kind == FeatureMapKind::FavorPositive) {
          first = std::exp(r.u[l] - r.h) / std::sqrt(double(f));
        } else if (kind == FeatureMapKind::FavorHyperbolic) {
          first = std::exp(r.u[l] - r.h) / std::sqrt(2.0 * double(f));
          second = std::exp(-r.u[l] - r.h) / std::sqrt(2.0 * double(f));
        } else {
          first = second = std::exp(r.h) / std::sqrt(double(f));
        }
        for (Index c = 0; c < d; ++c) {
          const double piece = (std::abs(w(l, c)) + std::abs(x(0, c)) * s) * s;
          j(l, c) = first * piece;
          if (two) j(f + l, c) = second * piece;
        }
      }
      return j;
    }
  }
}

MatrixD pair_magnitude(const MatrixD& x, const ref::RopeSpec& spec) {
  MatrixD out = x.cwiseAbs();
  const double g2 = spec.magnitude * spec.magnitude;
  for (const auto& [a, b] : ref::rotary_pairs(spec))
    for (Index i = 0; i < x.rows(); ++i) {
      const double sum = g2 * (std::abs(x(i, a)) + std::abs(x(i, b)));
      out(i, a) = sum;
      out(i, b) = sum;
    }
  return out;
}

Bounds gradient_bounds(const Setup& s, const ref::LinearResult& want) {
  const Problem& p = s.p;
  const Index n = s.q.rows(), n_k = s.k.rows(), d = s.q.cols();
  const MatrixD w = s.map->projection();
  const bool before = p.placement == RopePlacement::BeforeMap;
  const bool rotated =
      p.placement == RopePlacement::NumeratorOnly || p.placement == RopePlacement::Full;
  // The map's inputs and its features.
  const MatrixD qf = before ? ref::rotate_rows(*s.spec, s.q, p.q_offset) : s.q;
  const MatrixD kf = before ? ref::rotate_rows(*s.spec, s.k, p.k_offset) : s.k;
  const MatrixD pq = s.phi(qf), pk = s.phi(kf);
  // Magnitudes of dA/dphi_i (a function of the key j) and dA/dpsi_j (of the query i), and of B's.
  const MatrixD fa = rotated ? pair_magnitude(pk, *s.spec) : MatrixD(pk.cwiseAbs());
  const MatrixD fb = p.placement == RopePlacement::Full ? fa : MatrixD(pk.cwiseAbs());
  const MatrixD ga = rotated ? pair_magnitude(pq, *s.spec) : MatrixD(pq.cwiseAbs());
  const MatrixD gb = p.placement == RopePlacement::Full ? ga : MatrixD(pq.cwiseAbs());

  Bounds b;
  b.row_den = VectorD::Zero(n);
  b.row_den_magnitude = VectorD::Zero(n);
  VectorD a_weight = VectorD::Zero(n), b_weight = VectorD::Zero(n), amp = VectorD::Zero(n);
  for (Index i = 0; i < n; ++i) {
    if (want.admissible[std::size_t(i)] == 0) continue;
    // Without a denominator o_i = num_i: D_i = 1 exactly, and no term through den.
    const double den = p.denominator ? std::abs(want.den(i) + p.eps) : 1.0;
    const double den_mag = p.denominator ? want.den_magnitude(i) + p.eps : 1.0;
    b.row_den(i) = den;
    b.row_den_magnitude(i) = den_mag;
    if (den == 0) continue;
    const double cond = den_mag / den;
    b.cond_max = std::max(b.cond_max, cond);
    const double o = want.out.cols() > 0 ? want.out.row(i).cwiseAbs().maxCoeff() : 0.0;
    const double d_sum = s.d_out.row(i).cwiseAbs().sum();
    // The weights of the header: (2 + cond_i) on <g_i, v_j> (its own rounding, 1/D_i's, the
    // dA factor's), N_i / |D_i| + (2 + 2 cond_i) |o_i| on c_i (o_i's error, 1/D_i's, its own and
    // the dB factor's), (2 + cond_i) on dv's A_ij / D_i.
    amp(i) = (2 + cond) / den;
    a_weight(i) = d_sum * amp(i);
    b_weight(i) =
        p.denominator ? d_sum * (want.num_magnitude(i) / den + (2 + 2 * cond) * o) / den : 0.0;
  }
  // The causal mask, times a decay's g^(p_i - p_j): the weight of each pair's terms.
  const MatrixD mask = ref::decay_matrix(reference_spec(s.options, s.spec), n, n_k);
  VectorD vmax = VectorD::Zero(n_k);
  for (Index j = 0; j < n_k; ++j) vmax(j) = s.v.cols() > 0 ? s.v.row(j).cwiseAbs().maxCoeff() : 0.0;

  // dq: row i = (a_i sum_j mask_ij vmax_j fa_j + b_i sum_j mask_ij fb_j) |J_i|.
  const MatrixD sa = mask * vmax.asDiagonal() * fa, sb = mask * fb;
  // dk: row j = (vmax_j sum_i mask_ij a_i ga_i + sum_i mask_ij b_i gb_i) |J_j|.
  const MatrixD ta = mask.transpose() * a_weight.asDiagonal() * ga;
  const MatrixD tb = mask.transpose() * b_weight.asDiagonal() * gb;
  b.dq = MatrixD::Zero(n, d);
  b.dk = MatrixD::Zero(n_k, d);
  for (Index i = 0; i < n; ++i) {
    MatrixD jac = jacobian_magnitude(p.kind, w, qf.row(i));
    if (before) jac = jac * ref::rotation_matrix(*s.spec, p.q_offset + i).cwiseAbs();
    b.dq.row(i) = (a_weight(i) * sa.row(i) + b_weight(i) * sb.row(i)) * jac;
  }
  for (Index j = 0; j < n_k; ++j) {
    MatrixD jac = jacobian_magnitude(p.kind, w, kf.row(j));
    if (before) jac = jac * ref::rotation_matrix(*s.spec, p.k_offset + j).cwiseAbs();
    b.dk.row(j) = (vmax(j) * ta.row(j) + tb.row(j)) * jac;
  }
  // dv: sum_i M_ij |d_out_i| (2 + cond_i) / |D_i|.
  b.dv = want.magnitude.transpose() * amp.asDiagonal() * s.d_out.cwiseAbs();
  return b;
}

std::string describe(const Problem& p) {
  std::string s = std::string(to_string(p.kind)) + " " + to_string(p.placement) +
                  (p.causal ? " causal" : " non-causal") + " n=" + std::to_string(p.n) +
                  " n_k=" + std::to_string(p.n_k) + " d=" + std::to_string(p.d) +
                  " d_v=" + std::to_string(p.d_v) + " q_offset=" + std::to_string(p.q_offset) +
                  " k_offset=" + std::to_string(p.k_offset) + " eps=" + std::to_string(p.eps) +
                  (p.layout == RopeLayout::Half ? " half" : " interleaved") +
                  (p.partial ? " partial" : "") + (p.yarn ? " yarn" : "") +
                  (p.denominator ? "" : " no-denominator") +
                  (p.decay != 1.0 ? " decay=" + std::to_string(p.decay) : "");
  return s;
}

void check_problem(const Problem& p, Tally& tally) {
  const std::string name = describe(p);
  CAPTURE(name);
  const Setup s(p);
  const ref::LinearResult want = s.reference();
  const Gradients fd = finite_differences(s);
  const Bounds b = gradient_bounds(s, want);
  const double gamma_f = rounding_gamma_of<float>(s), gamma_d = rounding_gamma_of<double>(s);
  const bool ok_f = b.conditioned(gamma_f), ok_d = b.conditioned(gamma_d);
  const std::vector<Method> methods =
      p.causal ? kGradientMethods : std::vector<Method>{{CausalMethod::Scan, 64}};
  for (const Method& method : methods) {
    CAPTURE(int(method.method));
    CAPTURE(method.chunk);
    if (ok_d) {
      INFO("double");
      check_gradients(s.run<double>(method), fd, b, gamma_d);
      ++tally.run_double;
    } else {
      ++tally.skipped_double;
    }
    if (ok_f) {
      INFO("float");
      check_gradients(s.run<float>(method), fd, b, gamma_f);
      ++tally.run_float;
    } else {
      ++tally.skipped_float;
    }
  }
}

double rounding_gamma_of(const Setup& s, double u_kernel) {
  const bool before = s.p.placement == RopePlacement::BeforeMap;
  const MatrixD qf = before ? ref::rotate_rows(*s.spec, s.q, s.p.q_offset) : s.q;
  const MatrixD kf = before ? ref::rotate_rows(*s.spec, s.k, s.p.k_offset) : s.k;
  const double z = std::max(ref::exponent_size(*s.map, qf), ref::exponent_size(*s.map, kf));
  // ref::rounding_gamma<T> with T's unit roundoff passed in, and a decay's part.
  return 8 * (u_kernel + kUnitDouble) * (double(s.m + s.p.d + s.k.rows() + 16) + 2 * z) +
         ref::decay_gamma(reference_spec(s.options, s.spec), s.q.rows(), s.k.rows());
}

}  // namespace linrope::testing
