// The CPU engine's instruction sets (internal::PrefillLaunch::cpu_isa and DecodeLaunch::cpu_isa):
// the baseline ISA everywhere and, on x86 with GCC or Clang, builds for AVX2 + FMA and for
// AVX-512, one picked at run time by cpu::engine_isa (backend.h; it checks the features the
// target attributes below name).
#pragma once

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define FLASHKDA_X86_DISPATCH 1
#define FLASHKDA_TARGET_AVX2 __attribute__((target("avx2,fma")))
// 512-bit vectors where the compiler vectorises on its own: GCC takes it in the target string, Clang
// (which drops a target attribute with an option it does not know, and with it the ISA) as
// min_vector_width.
#if defined(__clang__)
#define FLASHKDA_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma"), min_vector_width(512)))
#else
#define FLASHKDA_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,prefer-vector-width=512")))
#endif
#endif

namespace flashkda::cpu {

constexpr int kIsaBaseline = 1, kIsaAvx2 = 2, kIsaAvx512 = 3;

}  // namespace flashkda::cpu
