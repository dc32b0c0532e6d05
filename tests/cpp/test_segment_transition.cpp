// The segment transition on the CPU (internal::segment_transition, launch_config.h): over a
// sequence the state map is affine, S_out = A S_in + B, and for any start state the returned
// (A, B) must give what the fp64 token recurrence gives from that state.
#include <gtest/gtest.h>

#include <vector>

#include "kda_test_utils.h"
#include "launch_config.h"

namespace flashkda::test {
namespace {

struct Case {
  GateForm gate;
  double g_min, g_max;
  int64_t K, V;
};

TEST(SegmentTransition, CpuMapsAnyStartStateLikeTheRecurrence) {
  const Case cases[] = {
      {GateForm::kLowerBound, -3, 3, 128, 128},
      {GateForm::kSoftplus, -8, 8, 48, 40},
      {GateForm::kPrecomputed, -1000, 0, 32, 64},
      {GateForm::kPrecomputed, -0.02, 0, 64, 16},  // little decay: A stays far from zero
  };
  for (const Case& c : cases) {
    KdaOptions o;
    o.seqlens = {0, 1, 37, 200};
    o.H = 2, o.K = c.K, o.V = c.V;
    o.dtype = DType::kF32;
    o.gate = c.gate, o.g_min = c.g_min, o.g_max = c.g_max;
    if (c.gate == GateForm::kPrecomputed) o.with_dt_bias = false;
    o.initial_state = StateKind::kF32;
    o.initial_state_std = 1.0;
    KdaInputs in(o);
    const Reference ref = run_reference(in);  // from the random initial state
    const int64_t NH = in.N * o.H;
    std::vector<float> transition(size_t(NH * c.K * c.K), NAN), zero_start(size_t(NH * c.V * c.K), NAN);
    PrefillParams p = in.params();
    p.initial_state = nullptr;  // not used by the transition
    internal::segment_transition(p, transition.data(), zero_start.data(), nullptr, 0);
    const std::vector<double> end =
        apply_transition(transition, zero_start, in.initial_state.values(), NH, c.V, c.K);
    const double err = rel_rms(end, ref.final_state);
    EXPECT_LE(err, 2e-6) << in.describe();
    report(std::string("cpu_transition_") + gate_form_name(c.gate) + "_state", err);

    // From zero the transition's B is the final state itself.
    KdaInputs zero = in;
    zero.opt.initial_state = StateKind::kNone;
    const Reference ref0 = run_reference(zero);
    std::vector<double> b(zero_start.begin(), zero_start.end());
    EXPECT_LE(rel_rms(b, ref0.final_state), 2e-6) << in.describe();
  }
}

TEST(SegmentTransition, RejectsBadArguments) {
  KdaOptions o;
  o.T = 20, o.H = 1;
  KdaInputs in(o);
  std::vector<float> a(128 * 128), b(128 * 128);
  PrefillParams p = in.params();
  expect_invalid([&] { internal::segment_transition(p, nullptr, b.data(), nullptr, 0); }, "transition");
  p.H = -1;
  EXPECT_THROW(internal::segment_transition(p, a.data(), b.data(), nullptr, 0), Error);
}

}  // namespace
}  // namespace flashkda::test
