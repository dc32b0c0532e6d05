// The CPU engine's instruction sets (internal::PrefillLaunch::cpu_isa and DecodeLaunch::cpu_isa):
// the baseline ISA everywhere and, on x86 with GCC or Clang, builds for AVX2 + FMA and for
// AVX-512, one picked at run time by cpu::engine_isa (backend.h; it checks the features the
// target attributes below name).
#pragma once

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define FLASHKDA_X86_DISPATCH 1
#define FLASHKDA_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define FLASHKDA_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,prefer-vector-width=512")))
#endif

namespace flashkda::cpu {

constexpr int kIsaBaseline = 1, kIsaAvx2 = 2, kIsaAvx512 = 3;

}  // namespace flashkda::cpu
