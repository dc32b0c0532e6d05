// "A serving loop at a fixed head size allocates nothing per call" on the CPU backend: after a
// first call per head size, forward and decode make no heap allocation (every operator new of the
// process is counted here; the OpenMP runtime's own allocations are not operator new).
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>
#include <vector>

#include "kda_test_utils.h"
#include "test_decode_fixture.h"

namespace {
std::atomic<long> g_news{0};
}

void* operator new(std::size_t n) {
  g_news.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return operator new(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }

namespace flashkda::test {
namespace {

TEST(CpuNoAlloc, PrefillAfterTheFirstCall) {
  KdaOptions o;
  o.seqlens = {37, 0, 100, 16};
  o.H = 3, o.K = 64, o.V = 32;
  o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
  KdaInputs in(o);
  const PrefillParams p = in.params();
  forward(p, nullptr, 0);  // first call: per-thread scratch
  const long before = g_news.load();
  for (int i = 0; i < 3; ++i) forward(p, nullptr, 0);
  EXPECT_EQ(g_news.load() - before, 0) << "operator new calls in steady-state prefill";
}

TEST(CpuNoAlloc, DecodeAfterTheFirstCall) {
  DecodeOptions o;
  o.N = 5, o.T = 3, o.H = 2, o.K = 64, o.V = 32;
  DecodeProblem prob(o);
  const DecodeParams p = prob.params();
  decode(p);
  const long before = g_news.load();
  for (int i = 0; i < 3; ++i) decode(p);
  EXPECT_EQ(g_news.load() - before, 0) << "operator new calls in steady-state decode";
}

}  // namespace
}  // namespace flashkda::test
