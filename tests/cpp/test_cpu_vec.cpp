// The CPU engine's AVX2 preprocessing helpers (src/cpu/vec_avx2.h): the two exponentials against
// std::exp, their special values (NaN, ±inf, overflow, underflow), four vectors at once against one,
// softplus against log1p(exp) in double, the 8 x 8 transpose, and the lane sums. Skipped, with the
// reason, where the processor lacks AVX2 + FMA or the build is not for x86.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cpu/vec_avx2.h"

namespace flashkda::cpu {
namespace {

#ifdef FLASHKDA_X86_DISPATCH
bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

// avx2::exp (kShift false) or avx2::exp_shift of x, in groups of 8 lanes (the tail padded with zeros).
template <bool kShift>
FLASHKDA_TARGET_AVX2 std::vector<float> apply8(const std::vector<float>& x) {
  std::vector<float> in(x), out((x.size() + 7) / 8 * 8);
  in.resize(out.size(), 0.0f);
  for (size_t i = 0; i < in.size(); i += 8) {
    const __m256 v = _mm256_loadu_ps(&in[i]);
    _mm256_storeu_ps(&out[i], kShift ? avx2::exp_shift(v) : avx2::exp(v));
  }
  out.resize(x.size());
  return out;
}
std::vector<float> exp8(const std::vector<float>& x) { return apply8<false>(x); }
std::vector<float> exp8_shift(const std::vector<float>& x) { return apply8<true>(x); }

FLASHKDA_TARGET_AVX2 void transpose8(float* dst, int64_t ldd, const float* src, int64_t lds) {
  avx2::transpose8x8(dst, ldd, src, lds);
}

// lane_sums of eight vectors given as rows.
FLASHKDA_TARGET_AVX2 void lane_sums8(const float (&in)[8][8], float (&out)[8]) {
  __m256 a[8];
  for (int r = 0; r < 8; ++r) a[r] = _mm256_loadu_ps(in[r]);
  _mm256_storeu_ps(out, avx2::lane_sums(a));
}

// |a - b| in units of b's last place (b > 0 normal); for subnormal b, in units of the smallest.
double ulps(float a, double b) {
  const double ulp = b >= double(std::numeric_limits<float>::min())
                         ? std::ldexp(1.0, std::ilogb(b) - 23)
                         : double(std::numeric_limits<float>::denorm_min());
  return std::abs(double(a) - b) / ulp;
}

TEST(CpuVecAvx2, ExpWithinTwoUlpsOverTheFloatRange) {
  if (!has_avx2()) GTEST_SKIP() << "this processor has no AVX2 + FMA";
  std::vector<float> x;
  for (float v = -103.0f; v <= 88.7f; v += 0.01171875f) x.push_back(v);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-103.0f, 88.7f);
  for (int i = 0; i < 20000; ++i) x.push_back(u(rng));
  const std::vector<float> y = exp8(x);
  double worst = 0.0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double ref = std::exp(double(x[i]));
    // subnormal results are rounded twice (by 2^{n/2}, then by the rest): within one smallest unit
    const double bound = ref >= double(std::numeric_limits<float>::min()) ? 2.0 : 1.0;
    worst = std::max(worst, ulps(y[i], ref));
    ASSERT_LE(ulps(y[i], ref), bound) << "x = " << x[i];
  }
  RecordProperty("worst_ulps", std::to_string(worst));
}

TEST(CpuVecAvx2, ExpSpecialValues) {
  if (!has_avx2()) GTEST_SKIP() << "this processor has no AVX2 + FMA";
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> y = exp8({nan, -nan, inf, -inf, 88.73f, 100.0f, 1e30f, -104.5f, -1e30f, 0.0f, -0.0f});
  EXPECT_TRUE(std::isnan(y[0]));
  EXPECT_TRUE(std::isnan(y[1]));
  EXPECT_EQ(y[2], inf);
  EXPECT_EQ(y[3], 0.0f);
  EXPECT_EQ(y[4], inf) << "e^88.73 is beyond FLT_MAX";
  EXPECT_EQ(y[5], inf);
  EXPECT_EQ(y[6], inf);
  EXPECT_EQ(y[7], 0.0f);
  EXPECT_EQ(y[8], 0.0f);
  EXPECT_EQ(y[9], 1.0f);
  EXPECT_EQ(y[10], 1.0f);
  // the largest finite result stays finite
  EXPECT_TRUE(std::isfinite(exp8({88.72f})[0]));
}

TEST(CpuVecAvx2, ExpShiftWithinTwoUlpsOnItsDomainAndCarriesNaN) {
  if (!has_avx2()) GTEST_SKIP() << "this processor has no AVX2 + FMA";
  std::vector<float> x;
  for (float v = -80.0f; v <= 80.0f; v += 0.00390625f) x.push_back(v);
  const std::vector<float> y = exp8_shift(x);
  for (size_t i = 0; i < x.size(); ++i) ASSERT_LE(ulps(y[i], std::exp(double(x[i]))), 2.0) << "x = " << x[i];
  const std::vector<float> n = exp8_shift({std::numeric_limits<float>::quiet_NaN(), 1.0f});
  EXPECT_TRUE(std::isnan(n[0]));
  EXPECT_FALSE(std::isnan(n[1]));
}

// avx2::exp<4> / exp_shift<4> (four vectors side by side) of x, 32 lanes at a time.
template <bool kShift>
FLASHKDA_TARGET_AVX2 std::vector<float> apply32(const std::vector<float>& x) {
  std::vector<float> in(x), out((x.size() + 31) / 32 * 32);
  in.resize(out.size(), 0.0f);
  for (size_t i = 0; i < in.size(); i += 32) {
    __m256 v[4];
    for (int j = 0; j < 4; ++j) v[j] = _mm256_loadu_ps(&in[i + 8 * j]);
    if (kShift) avx2::exp_shift<4>(v); else avx2::exp<4>(v);
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(&out[i + 8 * j], v[j]);
  }
  out.resize(x.size());
  return out;
}

TEST(CpuVecAvx2, FourVectorsAtOnceGiveTheBitsOfOne) {
  if (!has_avx2()) GTEST_SKIP() << "this processor has no AVX2 + FMA";
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> wide(-110.0f, 95.0f), shift(-80.0f, 80.0f);
  std::vector<float> x(4096), xs(4096);
  for (size_t i = 0; i < x.size(); ++i) x[i] = wide(rng), xs[i] = shift(rng);
  x[5] = std::numeric_limits<float>::quiet_NaN(), x[6] = std::numeric_limits<float>::infinity();
  xs[9] = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> a = exp8(x), b = apply32<false>(x), as = exp8_shift(xs), bs = apply32<true>(xs);
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(std::memcmp(&a[i], &b[i], 4), 0) << "exp, x = " << x[i];
    ASSERT_EQ(std::memcmp(&as[i], &bs[i], 4), 0) << "exp_shift, x = " << xs[i];
  }
}

// avx2::softplus<2> of x, 16 lanes at a time (the tail padded with zeros).
FLASHKDA_TARGET_AVX2 std::vector<float> softplus16(const std::vector<float>& x) {
  std::vector<float> in(x), out((x.size() + 15) / 16 * 16);
  in.resize(out.size(), 0.0f);
  for (size_t i = 0; i < in.size(); i += 16) {
    __m256 v[2] = {_mm256_loadu_ps(&in[i]), _mm256_loadu_ps(&in[i + 8])};
    avx2::softplus<2>(v);
    _mm256_storeu_ps(&out[i], v[0]), _mm256_storeu_ps(&out[i + 8], v[1]);
  }
  out.resize(x.size());
  return out;
}

TEST(CpuVecAvx2, SoftplusWithinTwoUlpsAndItsLimits) {
  if (!has_avx2()) GTEST_SKIP() << "this processor has no AVX2 + FMA";
  std::vector<float> x;
  for (float v = -110.0f; v <= 110.0f; v += 0.0009765625f) x.push_back(v);
  const std::vector<float> y = softplus16(x);
  for (size_t i = 0; i < x.size(); ++i) {
    const double ref = x[i] > 30.0f ? double(x[i]) : std::log1p(std::exp(double(x[i])));
    if (ref < double(std::numeric_limits<float>::denorm_min()) / 2) {
      ASSERT_EQ(y[i], 0.0f) << "x = " << x[i];
      continue;
    }
    ASSERT_LE(ulps(y[i], ref), 2.0) << "x = " << x[i];
  }
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> s = softplus16({std::numeric_limits<float>::quiet_NaN(), inf, -inf, 1e30f, -1e30f, 0.0f});
  EXPECT_TRUE(std::isnan(s[0]));
  EXPECT_EQ(s[1], inf);
  EXPECT_EQ(s[2], 0.0f);
  EXPECT_EQ(s[3], 1e30f);
  EXPECT_EQ(s[4], 0.0f);
  EXPECT_EQ(s[5], float(std::log(2.0)));
}

TEST(CpuVecAvx2, Transpose8x8WithStrides) {
  if (!has_avx2()) GTEST_SKIP() << "this processor has no AVX2 + FMA";
  const int64_t lds = 11, ldd = 13;
  std::vector<float> src(8 * lds), dst(8 * ldd, -1.0f);
  for (size_t i = 0; i < src.size(); ++i) src[i] = float(i);
  transpose8(dst.data(), ldd, src.data(), lds);
  for (int64_t i = 0; i < 8; ++i)
    for (int64_t j = 0; j < ldd; ++j)
      EXPECT_EQ(dst[i * ldd + j], j < 8 ? src[j * lds + i] : -1.0f) << "row " << i << " column " << j;
}

TEST(CpuVecAvx2, LaneSumsSumEachVector) {
  if (!has_avx2()) GTEST_SKIP() << "this processor has no AVX2 + FMA";
  float in[8][8], out[8];
  for (int r = 0; r < 8; ++r)
    for (int l = 0; l < 8; ++l) in[r][l] = float((r + 1) * 100 + l * (l + 1));  // exact in float
  lane_sums8(in, out);
  for (int r = 0; r < 8; ++r) {
    float want = 0.0f;
    for (int l = 0; l < 8; ++l) want += in[r][l];
    EXPECT_EQ(out[r], want) << "vector " << r;
  }
}
#else
TEST(CpuVecAvx2, NotBuilt) { GTEST_SKIP() << "the AVX2 helpers are built for x86 with GCC or Clang only"; }
#endif

}  // namespace
}  // namespace flashkda::cpu
