// The CPU engine's instruction sets as a test parameter (internal::PrefillLaunch::cpu_isa and
// DecodeLaunch::cpu_isa: 1 the baseline ISA, 2 AVX2 + FMA, 3 AVX-512).
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "launch_config.h"

namespace flashkda::test {

// The instruction set the running test asks of the CPU engine (IsaTest sets it).
inline int g_isa = 0;

inline const char* isa_name(int isa) { return isa == 1 ? "baseline" : isa == 2 ? "AVX2" : "AVX512"; }
inline std::string isa_param_name(const ::testing::TestParamInfo<int>& info) { return isa_name(info.param); }

// A suite run once per instruction set (INSTANTIATE_TEST_SUITE_P(Isa, Suite, kIsas, isa_param_name)),
// skipping, with the reason, those the processor lacks.
class IsaTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    g_isa = GetParam();
    if (internal::cpu_engine_isa(g_isa) != g_isa) GTEST_SKIP() << "this processor has no " << isa_name(g_isa);
  }
};
inline const auto kIsas = ::testing::Values(1, 2, 3);

}  // namespace flashkda::test
