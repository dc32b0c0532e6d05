// Host preprocessing helpers (src/common/host_math.h): stable activations, the three gate forms,
// L2 norm and the typed loads/stores.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "common/host_math.h"

namespace flashkda::host {
namespace {

TEST(HostMath, SigmoidAndSoftplusStayFiniteAtExtremes) {
  for (double x : {-1000.0, -50.0, -1.0, 0.0, 1.0, 50.0, 1000.0}) {
    EXPECT_TRUE(std::isfinite(sigmoid(x)));
    EXPECT_TRUE(std::isfinite(softplus(x)));
    EXPECT_TRUE(std::isfinite(sigmoid(float(x))));
    EXPECT_TRUE(std::isfinite(softplus(float(x))));
  }
  EXPECT_DOUBLE_EQ(sigmoid(0.0), 0.5);
  EXPECT_NEAR(sigmoid(-40.0), std::exp(-40.0), 1e-30);
  EXPECT_DOUBLE_EQ(softplus(30.0), 30.0);
  EXPECT_NEAR(softplus(-30.0), std::exp(-30.0), 1e-25);
  EXPECT_NEAR(softplus(1.0), std::log(1.0 + std::exp(1.0)), 1e-15);
}

TEST(HostMath, GateFormsFollowSpec) {
  const float A_log[2] = {0.5f, -1.0f};
  const float dt_bias[2 * 3] = {0.1f, -0.2f, 0.3f, 1.0f, 2.0f, -3.0f};
  Preprocess pre;
  pre.A_log = A_log;
  pre.dt_bias = dt_bias;
  pre.lower_bound = -4.0f;
  const double g = 0.7;
  const double x = g + double(dt_bias[3 + 2]);
  pre.gate = GateForm::kLowerBound;
  double row[3] = {g, g, g};
  EXPECT_NEAR(HeadGate<double>(pre, 1, 3)(2, g), -4.0 / (1.0 + std::exp(-std::exp(-1.0) * x)), 1e-14);
  HeadGate<double>(pre, 1, 3).row<StdMath<double>>(row, row, 3);
  EXPECT_EQ(row[2], HeadGate<double>(pre, 1, 3)(2, g));  // the row form is the same formula
  EXPECT_EQ(HeadGate<double>(pre, 1, 3)(2, -1e6), 0.0);   // e^{-x} overflows: the limit, not NaN
  pre.gate = GateForm::kSoftplus;
  EXPECT_NEAR(HeadGate<double>(pre, 1, 3)(2, g), -std::exp(-1.0) * std::log1p(std::exp(x)), 1e-14);
  pre.dt_bias = nullptr;
  EXPECT_NEAR(HeadGate<double>(pre, 0, 3)(1, g), -std::exp(0.5) * std::log1p(std::exp(g)), 1e-14);
  pre.gate = GateForm::kPrecomputed;
  EXPECT_EQ(HeadGate<double>(pre, 0, 3)(0, -123.0), -123.0);
  pre.dt_bias = dt_bias;  // not added to a precomputed log-decay
  EXPECT_EQ(HeadGate<double>(pre, 1, 3)(2, -123.0), -123.0);
}

// The one definition of the gate forms (common/gate.h) with the host's functions is the spec's
// formula, and log_decay dispatches on the form.
TEST(HostMath, GateDefinitionsDispatchOnTheForm) {
  using M = StdMath<double>;
  const double lb = -4.0, a_scale = 0.8, x = 0.3;
  EXPECT_EQ(gate::lower_bound<M>(lb, a_scale, x), lb / (1.0 + std::exp(-(a_scale * x))));
  EXPECT_EQ(gate::softplus<M>(a_scale, x), -a_scale * std::log1p(std::exp(x)));
  EXPECT_EQ(gate::log_decay<M>(GateForm::kLowerBound, lb, a_scale, x), gate::lower_bound<M>(lb, a_scale, x));
  EXPECT_EQ(gate::log_decay<M>(GateForm::kSoftplus, lb, a_scale, x), gate::softplus<M>(a_scale, x));
  EXPECT_EQ(gate::log_decay<M>(GateForm::kPrecomputed, lb, a_scale, x), x);
}

TEST(HostMath, L2NormAndBeta) {
  std::vector<double> x = {3.0, 4.0};
  l2_normalize(x.data(), 2);
  EXPECT_NEAR(x[0], 3.0 / std::sqrt(25.0 + 1e-6), 1e-15);
  std::vector<double> zero = {0.0, 0.0};
  l2_normalize(zero.data(), 2);
  EXPECT_EQ(zero[0], 0.0);
  Preprocess pre;
  EXPECT_DOUBLE_EQ(beta_activation(pre, 0.0), 0.5);
  pre.beta_is_logit = false;
  EXPECT_DOUBLE_EQ(beta_activation(pre, 0.25), 0.25);
}

TEST(HostMath, TypedLoadsAndStoresRoundTrip) {
  const std::vector<float> src = {1.0f, -2.5f, 3.140625f, 1e-3f};
  std::vector<uint16_t> b16(4);
  store_row(b16.data(), DType::kBF16, 0, 4, src.data());
  std::vector<double> back(4);
  load_row(b16.data(), DType::kBF16, 0, 4, back.data());
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(back[i], src[i], std::abs(src[i]) * (1.0 / 256));
  EXPECT_EQ(back[2], 3.140625);  // representable in bf16
  std::vector<float> f32(4);
  store_row(f32.data(), DType::kF32, 0, 4, back.data());
  EXPECT_EQ(load<double>(f32.data(), DType::kF32, 1), -2.5);
  std::vector<double> state(4, 7.0);
  load_state<double>(nullptr, DType::kF32, 0, 0, 1, 2, 2, state.data());
  for (double s : state) EXPECT_EQ(s, 0.0);
}

}  // namespace
}  // namespace flashkda::host
