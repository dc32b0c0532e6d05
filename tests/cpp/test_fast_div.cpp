// The GPU kernels' fixed-divisor division (src/cuda/common/fast_div.h), on the host: n / d for every
// divisor the kernels use it with (head counts, 1 <= d < 2^31) and every dividend below 2^31.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "cuda/common/fast_div.h"

namespace flashkda::cuda {
namespace {

std::vector<int32_t> dividends(std::mt19937_64& rng) {
  std::vector<int32_t> n;
  for (int32_t i = 0; i < 4096; ++i) n.push_back(i);
  for (int32_t i = 0; i < 4096; ++i) n.push_back(INT32_MAX - i);
  for (int k = 1; k < 31; ++k) {  // around every power of two
    for (int32_t e = -2; e <= 2; ++e) n.push_back((int32_t(1) << k) + e);
  }
  std::uniform_int_distribution<int32_t> any(0, INT32_MAX);
  for (int i = 0; i < 20000; ++i) n.push_back(any(rng));
  return n;
}

TEST(FastDiv32, EqualsIntegerDivisionBelow2To31) {
  std::mt19937_64 rng(20261205);
  std::vector<int32_t> divisors;
  for (int32_t d = 1; d <= 1024; ++d) divisors.push_back(d);
  for (int k = 1; k < 31; ++k) {
    for (int32_t e = -1; e <= 1; ++e) divisors.push_back((int32_t(1) << k) + e);
  }
  divisors.push_back(INT32_MAX);
  std::uniform_int_distribution<int32_t> any(1, INT32_MAX);
  for (int i = 0; i < 200; ++i) divisors.push_back(any(rng));
  const std::vector<int32_t> n = dividends(rng);
  int64_t wrong = 0;
  for (int32_t d : divisors) {
    const FastDiv32 f(d);
    for (int32_t x : n) {
      if (f.div(x) != x / d) {
        if (++wrong <= 5) ADD_FAILURE() << x << " / " << d << ": " << f.div(x) << " against " << x / d;
      }
    }
  }
  EXPECT_EQ(wrong, 0);
}

TEST(FastDiv32, EveryDividendForSmallHeadCounts) {
  // The decode kernels divide item numbers by H: every n below 2^22 for the head counts of real models.
  for (int32_t d : {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128}) {
    const FastDiv32 f(d);
    int64_t wrong = 0;
    for (int32_t x = 0; x < (int32_t(1) << 22); ++x) wrong += f.div(x) != x / d;
    EXPECT_EQ(wrong, 0) << "d = " << d;
  }
}

}  // namespace
}  // namespace flashkda::cuda
