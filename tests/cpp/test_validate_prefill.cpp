// Argument validation of the prefill entry points: every bad input throws flashkda::Error with
// kInvalidArgument and a message naming the argument, and leaves out / final_state untouched.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "backend.h"
#include "kda_test_utils.h"

namespace flashkda::test {
namespace {

// Applies `mutate` to valid params, then runs forward, workspace_size and reference_forward:
// each must reject it, and out / final_state must stay bit-identical (NaN poison).
// reference_forward writes its own fp64 out and final_state and ignores those of params
// (`outputs_only`: the mutation concerns only them, so it must accept it).
void expect_rejected(const std::function<void(PrefillParams&)>& mutate, const std::string& needle,
                     KdaOptions opt = {}, bool outputs_only = false) {
  SCOPED_TRACE(needle);
  opt.T = opt.seqlens.empty() ? 20 : opt.T;
  opt.H = 2;
  opt.K = opt.V = 32;
  opt.final_state = StateKind::kF32;
  KdaInputs in(opt);
  in.poison_outputs();
  const std::vector<unsigned char> out_before = in.out.bytes, fs_before = in.final_state.bytes;
  PrefillParams p = in.params();
  mutate(p);
  std::vector<double> ref_out(size_t(std::max<int64_t>(1, opt.T * opt.H * 300)));
  expect_invalid([&] { forward(p, nullptr, 0); }, needle);
  expect_invalid([&] { workspace_size(p); }, needle);
  if (outputs_only) EXPECT_NO_THROW(reference_forward(p, ref_out.data(), nullptr));
  else expect_invalid([&] { reference_forward(p, ref_out.data(), nullptr); }, needle);
  EXPECT_TRUE(in.out.bytes == out_before) << "out was written before validation failed";
  EXPECT_TRUE(in.final_state.bytes == fs_before) << "final_state was written before validation failed";
}

KdaOptions varlen(DType cu_dtype) {
  KdaOptions o;
  o.seqlens = {5, 0, 12, 3};
  o.cu_dtype = cu_dtype;
  return o;
}

TEST(ValidatePrefill, RejectsNullTensors) {
  expect_rejected([](PrefillParams& p) { p.q = nullptr; }, "q must not be null");
  expect_rejected([](PrefillParams& p) { p.k = nullptr; }, "k must not be null");
  expect_rejected([](PrefillParams& p) { p.v = nullptr; }, "v must not be null");
  expect_rejected([](PrefillParams& p) { p.g = nullptr; }, "g must not be null");
  expect_rejected([](PrefillParams& p) { p.beta = nullptr; }, "beta must not be null");
  expect_rejected([](PrefillParams& p) { p.out = nullptr; }, "out must not be null", {}, true);
}

TEST(ValidatePrefill, RejectsUnknownPrecision) {
  expect_rejected([](PrefillParams& p) { p.precision = static_cast<Precision>(7); }, "precision must be");
  expect_rejected([](PrefillParams& p) { p.precision = static_cast<Precision>(-1); }, "precision must be");
}

TEST(ValidatePrefill, RejectsNegativeSizes) {
  expect_rejected([](PrefillParams& p) { p.B = -1; }, "B must be >= 0");
  expect_rejected([](PrefillParams& p) { p.T = -3; }, "T must be >= 0");
  expect_rejected([](PrefillParams& p) { p.H = -2; }, "H must be >= 0");
}

TEST(ValidatePrefill, RejectsSizesBeyondInt64Offsets) {
  // Element counts above 2^56, or products that overflow int64, are refused before any use.
  expect_rejected([](PrefillParams& p) { p.B = int64_t(1) << 20, p.T = int64_t(1) << 40; },
                  "q [B, T, H, K]: shape [1048576, 1099511627776, 2, 32] gives more than 2^56 elements");
  expect_rejected([](PrefillParams& p) { p.T = std::numeric_limits<int64_t>::max(); }, "q [B, T, H, K]");
  expect_rejected([](PrefillParams& p) { p.H = int64_t(1) << 62; }, "q [B, T, H, K]");
  // No tokens, but a state per sequence: B sequences of H x V x K states.
  expect_rejected([](PrefillParams& p) { p.T = 0, p.B = int64_t(1) << 50; }, "states [N, H, V, K]");
  expect_rejected(
      [](PrefillParams& p) { p.num_seqs = int64_t(1) << 55; }, "states [N, H, V, K]", varlen(DType::kI32));
}

TEST(ValidatePrefill, MemorySpaceRules) {
  using detail::MemorySpace;
  const auto ok = [](Backend b, int device, MemorySpace space, int on) {
    EXPECT_NO_THROW(detail::check_memory_space(b, device, "k", {space, on}, ""));
  };
  const auto bad = [](Backend b, int device, MemorySpace space, int on, const std::string& needle) {
    expect_invalid([&] { detail::check_memory_space(b, device, "k", {space, on}, "decode: "); }, needle);
  };
  // The CPU backend (q in host memory) reads everything but device memory.
  ok(Backend::kCpu, -1, MemorySpace::kHost, -1);
  ok(Backend::kCpu, -1, MemorySpace::kPinnedHost, 0);
  ok(Backend::kCpu, -1, MemorySpace::kManaged, 0);
  bad(Backend::kCpu, -1, MemorySpace::kDevice, 1, "decode: k is device memory (device 1) but q is host memory");
  // The CUDA backend, running on device 1: its own device memory, managed or page-locked memory.
  ok(Backend::kCuda, 1, MemorySpace::kDevice, 1);
  ok(Backend::kCuda, 1, MemorySpace::kManaged, 0);
  ok(Backend::kCuda, 1, MemorySpace::kPinnedHost, 0);
  bad(Backend::kCuda, 1, MemorySpace::kHost, -1, "decode: k is pageable host memory but q is on the GPU");
  bad(Backend::kCuda, 1, MemorySpace::kDevice, 0, "decode: k is on device 0 but the call runs on device 1");
  // Host pointers on a machine without a GPU: host memory, and the CPU backend takes them.
  std::vector<float> host(4);
  EXPECT_EQ(detail::pointer_info(host.data()).space, MemorySpace::kHost);
  EXPECT_EQ(backend_of(host.data()), Backend::kCpu);
  EXPECT_NO_THROW(detail::check_reachable(Backend::kCpu, {{host.data(), "k"}, {nullptr, "v"}}, ""));
}

TEST(ValidatePrefill, RejectsHeadSizesOutsideCpuRange) {
  expect_rejected([](PrefillParams& p) { p.K = 0; }, "K must be in [1, 256]");
  expect_rejected([](PrefillParams& p) { p.K = 257; }, "K must be in [1, 256]");
  expect_rejected([](PrefillParams& p) { p.V = 0; }, "V must be in [1, 256]");
  expect_rejected([](PrefillParams& p) { p.V = 512; }, "V must be in [1, 256]");
}

TEST(ValidatePrefill, RejectsBadDtypes) {
  expect_rejected([](PrefillParams& p) { p.dtype = DType::kI32; }, "dtype (of q, k, v, out)");
  expect_rejected([](PrefillParams& p) { p.g_dtype = DType::kI64; }, "g_dtype");
  expect_rejected([](PrefillParams& p) { p.beta_dtype = DType::kI32; }, "beta_dtype");
  expect_rejected([](PrefillParams& p) { p.final_state_dtype = DType::kI32; }, "final_state_dtype", {}, true);
  KdaOptions with_init;
  with_init.initial_state = StateKind::kF32;
  expect_rejected([](PrefillParams& p) { p.initial_state_dtype = DType::kI64; }, "initial_state_dtype", with_init);
}

// K, V = 128 and bf16 q, k, v on the GPU: valid arguments the kernels do not serve (kUnsupported,
// NotImplementedError in Python, as decode's), not bad ones.
TEST(ValidatePrefill, CudaBackendRulesK128Bf16AndGridLimit) {
  KdaOptions o;
  o.K = o.V = 128;
  o.T = 4;
  KdaInputs in(o);
  PrefillParams p = in.params();
  EXPECT_NO_THROW(detail::validate_prefill(p, Backend::kCuda));
  p.K = 64;
  expect_invalid([&] { detail::validate_prefill(p, Backend::kCuda); }, "K must be 128 on the CUDA backend",
                 ErrorCode::kUnsupported);
  p.K = 128;
  p.V = 256;
  expect_invalid([&] { detail::validate_prefill(p, Backend::kCuda); }, "V must be 128 on the CUDA backend",
                 ErrorCode::kUnsupported);
  p.V = 128;
  // a bad argument is named as one whatever the shape (the GPU's K = 128 is checked last)
  p.K = 64;
  p.q = nullptr;
  expect_invalid([&] { detail::validate_prefill(p, Backend::kCuda); }, "q must not be null");
  p.q = in.params().q;
  p.K = 300;
  expect_invalid([&] { detail::validate_prefill(p, Backend::kCuda); }, "K must be in [1, 256]");
  p.K = 128;
  p.dtype = DType::kF32;
  expect_invalid([&] { detail::validate_prefill(p, Backend::kCuda); }, "bfloat16 on the CUDA backend",
                 ErrorCode::kUnsupported);
  EXPECT_NO_THROW(detail::validate_prefill(p, Backend::kCpu));

  // The grid limit is a size the GPU does not support (kUnsupported), not a bad argument.
  p.dtype = DType::kBF16;
  p.T = int64_t(1) << 34;  // 2^30 chunks x 2 heads: one K1 CTA each exceeds the 2^31 - 1 grid
  p.H = 2;
  try {
    detail::validate_prefill(p, Backend::kCuda);
    ADD_FAILURE() << "no error for 2^31 chunk-head pairs";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported) << e.what();
    EXPECT_NE(std::string(e.what()).find("exceed the GPU grid limit"), std::string::npos) << e.what();
  }
  p.H = 1;  // 2^30 + 1 pairs fit
  EXPECT_NO_THROW(detail::validate_prefill(p, Backend::kCuda));
}

TEST(ValidatePrefill, RejectsBadCuSeqlens) {
  for (DType cu : {DType::kI32, DType::kI64}) {
    SCOPED_TRACE(dtype_name(cu));
    const KdaOptions o = varlen(cu);
    expect_rejected([](PrefillParams& p) { p.B = 2; }, "B must be 1 when cu_seqlens is given", o);
    expect_rejected([](PrefillParams& p) { p.num_seqs = -1; }, "num_seqs must be >= 0", o);
    expect_rejected([](PrefillParams& p) { p.cu_seqlens_dtype = DType::kF32; }, "cu_seqlens_dtype", o);
    expect_rejected([](PrefillParams& p) { p.num_seqs = 2; }, "cu_seqlens[2]=5 must equal the token count B*T=20",
                    o);
    expect_rejected([](PrefillParams& p) { p.T = 21; }, "must equal the token count", o);
    // cu_seqlens values themselves: first entry, order.
    auto set_cu = [cu](PrefillParams& p, int64_t i, int64_t value) {
      if (cu == DType::kI64) {
        const_cast<int64_t*>(static_cast<const int64_t*>(p.cu_seqlens))[i] = value;
      } else {
        const_cast<int32_t*>(static_cast<const int32_t*>(p.cu_seqlens))[i] = int32_t(value);
      }
    };
    expect_rejected([&](PrefillParams& p) { set_cu(p, 0, 1); }, "cu_seqlens[0] must be 0", o);
    // cu = [0, 5, 5, 17, 20] -> [0, 5, 18, 17, 20]
    expect_rejected([&](PrefillParams& p) { set_cu(p, 2, 18); },
                    "cu_seqlens must be non-decreasing; cu_seqlens[3]=17 < cu_seqlens[2]=18", o);
  }
}

TEST(ValidatePrefill, RejectsBadGateParameters) {
  expect_rejected([](PrefillParams& p) { p.pre.lower_bound = 0.0f; }, "lower_bound must lie in [-5, 0)");
  expect_rejected([](PrefillParams& p) { p.pre.lower_bound = -5.5f; }, "lower_bound must lie in [-5, 0)");
  expect_rejected([](PrefillParams& p) { p.pre.lower_bound = std::nanf(""); }, "lower_bound must lie in [-5, 0)");
  expect_rejected([](PrefillParams& p) { p.pre.A_log = nullptr; }, "A_log must not be null for the lower_bound");
  expect_rejected(
      [](PrefillParams& p) {
        p.pre.gate = GateForm::kSoftplus;
        p.pre.A_log = nullptr;
      },
      "A_log must not be null for the softplus");
  expect_rejected([](PrefillParams& p) { p.pre.gate = GateForm(7); }, "gate must be a GateForm");
}

TEST(ValidatePrefill, RejectsNonFiniteScale) {
  for (float s : {std::nanf(""), std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()}) {
    expect_rejected(
        [s](PrefillParams& p) {
          p.pre.has_scale = true;
          p.pre.scale = s;
        },
        "scale must be finite");
  }
}

TEST(ValidatePrefill, AcceptsEmptyProblems) {
  PrefillParams p;  // everything null, B = T = H = 0
  float A_log[4] = {};  // [H] for the H = 4 below (AddressSanitizer caught a 1-element array here)
  p.pre.A_log = A_log;
  EXPECT_NO_THROW(forward(p, nullptr, 0));
  p.B = 2;  // B*T*H == 0 still: null data pointers of empty tensors are fine
  p.H = 4;
  EXPECT_NO_THROW(forward(p, nullptr, 0));
  const int32_t cu[1] = {0};
  p.B = 1;
  p.cu_seqlens = cu;
  p.num_seqs = 0;
  EXPECT_NO_THROW(forward(p, nullptr, 0));
  // A precomputed gate needs no A_log.
  p.pre.gate = GateForm::kPrecomputed;
  p.pre.A_log = nullptr;
  EXPECT_NO_THROW(forward(p, nullptr, 0));
}

}  // namespace
}  // namespace flashkda::test
