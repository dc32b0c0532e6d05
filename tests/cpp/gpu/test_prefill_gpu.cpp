// GPU prefill (sm_90a) against the fp64 token recurrence: every option of the API, odd lengths,
// varlen, states, gate forms, adversarial inputs, determinism, CUDA-graph capture, bad cu_seqlens.
// Skips with a reason when no Hopper GPU is visible.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <memory>
#include <vector>

#include "common/host_math.h"
#include "device_problem.h"
#include "fuzz_params.h"
#include "kda_test_utils.h"
#include "launch_config.h"

namespace flashkda::test {
namespace {

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

// The chunk-16 kernels' tests: their calls run without the fused kernel's few-head pieces unless a
// test forces the fused kernel or its pieces (DeviceProblem::chunk16_rule).
[[maybe_unused]] const bool kChunk16Rule = (DeviceProblem::chunk16_rule = true);

constexpr double kTolOut = 6e-3;    // issue target: within FlashKDA's measured level (5.8e-3 / 5.0e-3)
constexpr double kTolState = 6e-3;
// Every precision mode (flashkda::Precision); the precise and balanced modes are held to the same
// bounds, the fast mode to its own where it is looser.
constexpr Precision kModes[] = {Precision::kPrecise, Precision::kBalanced, Precision::kFast};

class PrefillGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no Hopper (sm_90) CUDA GPU visible: GPU prefill tests skipped";
  }
};

struct Errors {
  double out = 0, state = 0;
};

// Runs a problem on the GPU with poisoned outputs and compares it with the fp64 reference.
Errors check_against_reference(KdaInputs& in, double tol_out = kTolOut, double tol_state = kTolState,
                               internal::PrefillLaunch launch = {}) {
  const Reference ref = run_reference(in);
  DeviceProblem dev(in, launch);
  dev.poison();
  dev.run();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  dev.download();

  Errors e;
  const std::vector<double> out = in.out.values();
  EXPECT_EQ(count_nonfinite(out), 0) << in.describe();
  EXPECT_TRUE(in.out.guard_intact()) << "out guard overwritten: " << in.describe();
  e.out = rel_rms(out, ref.out);
  EXPECT_LE(e.out, tol_out) << in.describe();
  if (in.opt.final_state != StateKind::kNone) {
    const std::vector<double> fin = in.final_state.values();
    EXPECT_EQ(count_nonfinite(fin), 0) << in.describe();
    EXPECT_TRUE(in.final_state.guard_intact()) << "final_state guard overwritten: " << in.describe();
    e.state = rel_rms(fin, ref.final_state);
    EXPECT_LE(e.state, tol_state) << in.describe();
  }
  return e;
}

TEST_F(PrefillGpu, OddLengthsAllStateCombinations) {
  const StateKind kinds[] = {StateKind::kNone, StateKind::kF32, StateKind::kBF16};
  for (int64_t T : {0, 1, 15, 16, 17, 31, 100, 1000}) {
    for (StateKind init : kinds) {
      for (StateKind fin : kinds) {
        KdaOptions o;
        o.B = 2, o.T = T, o.H = 3;
        o.initial_state = init, o.final_state = fin;
        KdaInputs in(o);
        check_against_reference(in);
      }
    }
  }
}

TEST_F(PrefillGpu, VarlenWithEmptySequencesInt32AndInt64) {
  for (DType cu : {DType::kI32, DType::kI64}) {
    KdaOptions o;
    o.seqlens = {0, 300, 17, 0, 1024, 77, 1, 0, 16};
    o.cu_dtype = cu;
    o.H = 4;
    o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
    KdaInputs in(o);
    check_against_reference(in);
  }
}

TEST_F(PrefillGpu, SpecAccuracyCaseReportsErrors) {
  // docs/SPEC.md §6: varlen [300, 17, 1024, 77], H = 4, random fp32 initial state x0.1, bf16 inputs.
  KdaOptions o;
  o.seqlens = {300, 17, 1024, 77};
  o.H = 4;
  o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
  KdaInputs in(o);
  const Errors e = check_against_reference(in);
  report("spec6_out_rel_rms", e.out);
  report("spec6_state_rel_rms", e.state);
}

TEST_F(PrefillGpu, GateFormsAndFlags) {
  struct Case {
    GateForm gate;
    double g_min, g_max, bias;
    DType g_dtype;
    bool l2norm, logit, scale;
  };
  const Case cases[] = {
      {GateForm::kLowerBound, -8, 8, 8, DType::kBF16, true, true, false},
      {GateForm::kLowerBound, -8, 8, -8, DType::kF32, true, true, false},
      {GateForm::kSoftplus, -8, 8, 8, DType::kBF16, true, true, false},
      {GateForm::kSoftplus, -8, 8, -8, DType::kF32, true, true, false},
      {GateForm::kPrecomputed, -1000, 0, 0, DType::kF32, true, true, false},
      {GateForm::kPrecomputed, -0.05, 0, 0, DType::kF32, true, true, false},
      {GateForm::kPrecomputed, -2, 0, 0, DType::kBF16, false, false, true},
      {GateForm::kLowerBound, -3, 3, 1, DType::kBF16, false, true, true},
      // a dt_bias passed with precomputed gates is not added (a = g, docs/SPEC.md §2), as on the
      // CPU and in decode (K1 added it before the gate forms were written once, common/gate.h)
      {GateForm::kPrecomputed, -2, 0, 3, DType::kF32, true, true, false},
  };
  // Both precision modes: the fast one is a public option too (scripts/sim_rounding.py puts it
  // at ~3.3e-3 on these gates).
  for (const Precision precision : kModes)
  for (const Case& c : cases) {
    KdaOptions o;
    o.T = 333, o.H = 2, o.B = 2;
    o.precision = precision;
    o.gate = c.gate, o.g_min = c.g_min, o.g_max = c.g_max, o.g_dtype = c.g_dtype;
    o.dt_bias_min = o.dt_bias_max = c.bias;
    if (c.gate == GateForm::kSoftplus) o.A_log_min = 0, o.A_log_max = 2;
    o.l2norm = c.l2norm, o.beta_is_logit = c.logit;
    o.has_scale = c.scale, o.scale = 0.07f;
    o.beta_dtype = c.logit ? DType::kBF16 : DType::kF32;
    o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
    KdaInputs in(o);
    const Errors e = check_against_reference(in);
    // Named per case: the fast mode's level on extreme gates, and the fp32 state error of wide
    // chunks (precomputed down to -1000: docs/DESIGN.md "Gates without overflow").
    const auto num = [](double x) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%g", x);
      return std::string(buf);
    };
    const std::string label = std::string(precision_name(precision)) + " " + gate_form_name(c.gate) + " [" + num(c.g_min) + ", " + num(c.g_max) + "] bias " +
                              num(c.bias);
    report(label + " out", e.out);
    report(label + " state", e.state);
  }
}

// One key repeated for every token, b ~ 1 and almost no decay: the Neumann series of (I+L)^-1
// cancels catastrophically here; forward substitution must stay exact.
// The fast mode (Precision::kFast) rounds k_restored, U and inv_b to bf16, and on this input that
// noise accumulates in state directions the delta rule never corrects (docs/DESIGN.md): its bound
// here is the measured level with a margin, not the 6e-3 of the precise mode (fla measures 2.0e-2
// / 2.4e-2 on this input at T=4096, FlashKDA overflows).
// The repeated-key adversarial input: T = 16384, H = 2, every token's key that of token 0 (per
// head), raw gate -12, raw beta 8; fp32 final state.
KdaOptions repeated_key_options(Precision precision) {
  KdaOptions o;
  o.T = 16384, o.H = 2;
  o.final_state = StateKind::kF32;
  o.precision = precision;
  return o;
}

// The benchmark's long-memory regime (bench_prefill.py): random lower-bound gates, 8 of every
// head's 128 channels at dt_bias = -8 (near-zero decay); T tokens (3000 unless given), H = 2, fp32 states.
KdaInputs long_memory_inputs(int64_t T = 3000) {
  KdaOptions o;
  o.T = T, o.H = 2;
  o.g_min = -2, o.g_max = 2, o.A_log_min = 0, o.A_log_max = 1, o.dt_bias_min = 0, o.dt_bias_max = 1;
  o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
  KdaInputs in(o);
  for (int64_t h = 0; h < o.H; ++h)
    for (int64_t c = 0; c < 8; ++c) in.dt_bias[h * o.K + c] = -8.0f;
  return in;
}

void make_repeated_key(KdaInputs& in) {
  const KdaOptions& o = in.opt;
  for (int64_t t = 1; t < o.T; ++t)
    for (int64_t h = 0; h < o.H; ++h)
      for (int64_t c = 0; c < o.K; ++c) in.k.set((t * o.H + h) * o.K + c, in.k.get(h * o.K + c));
  for (int64_t i = 0; i < in.g.count; ++i) in.g.set(i, -12.0);
  for (int64_t i = 0; i < in.beta.count; ++i) in.beta.set(i, 8.0);
}

TEST_F(PrefillGpu, RepeatedKeyExtremeBetaLongSequence) {
  for (const Precision precision : kModes) {
    KdaInputs in(repeated_key_options(precision));
    make_repeated_key(in);
    const bool fast = precision == Precision::kFast;
    // fast: the default launch cuts this problem (H = 2) into 32 segments, and the bf16-rounded
    // transitions compound along the chain: 4.0e-2 / 4.7e-2 and 4.9e-2 / 6.1e-2 measured on the
    // H200 in two runs (2026-12-01, fresh inputs each; one CTA walking the sequence: 8.8e-3 /
    // 1.1e-2), bounded at 1e-1. The precise and balanced modes are held to the contract of
    // docs/VALIDATION.md on this input, 3e-3 / 2e-3.
    const Errors e = fast ? check_against_reference(in, 1e-1, 1e-1) : check_against_reference(in, 3e-3, 2e-3);
    const std::string name = std::string("repeated_key_") + precision_name(precision);
    report(name + "_out_rel_rms", e.out);
    report(name + "_state_rel_rms", e.state);
  }
}

// PrefillParams::precision reaches the kernels: every mode gives its own outputs, each the same
// on a repeat.
TEST_F(PrefillGpu, PrecisionParameterSelectsTheMode) {
  KdaOptions o;
  o.seqlens = {300, 17, 64};
  o.H = 4;
  o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
  KdaInputs in(o);
  auto run = [&](Precision precision) {
    in.opt.precision = precision;
    DeviceProblem dev(in);
    dev.poison();
    dev.run();
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    dev.download();
    return std::make_pair(in.out.bytes, in.final_state.bytes);
  };
  std::vector<std::pair<std::vector<unsigned char>, std::vector<unsigned char>>> results;
  for (const Precision precision : kModes) {
    results.push_back(run(precision));
    EXPECT_TRUE(results.back() == run(precision)) << precision_name(precision) << " is not repeatable";
  }
  for (size_t i = 0; i < results.size(); ++i)
    for (size_t j = i + 1; j < results.size(); ++j)
      EXPECT_FALSE(results[i].first == results[j].first)
          << precision_name(kModes[i]) << " and " << precision_name(kModes[j]) << " gave bit-identical outputs";
}

// The precise mode runs two policies (docs/DESIGN.md "Precision as an option"): S, k_decayed and
// q_decayed in fp16 with a row-scale range guard where q and k are L2-normalised (what every
// default-mode test here runs), the bf16 split of S otherwise. This runs the split one
// (internal::PrefillLaunch::f16_operands = -1) on the inputs the fp16 one is most sensitive to,
// serial and in segments: random varlen, long-memory channels, precomputed log-decays to -1000
// and the repeated key (the contract's 3e-3 / 2e-3), each reported by name.
TEST_F(PrefillGpu, SplitStatePolicyMatchesReference) {
  for (const int64_t seg : {int64_t(-1), int64_t(16)}) {
    const internal::PrefillLaunch launch{0, seg, -1};
    const std::string tag = std::string("split state") + (seg > 0 ? " segments" : " serial");
    {
      KdaOptions o;
      o.seqlens = {300, 17, 1024, 77};
      o.H = 4;
      o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
      KdaInputs in(o);
      const Errors e = check_against_reference(in, kTolOut, kTolState, launch);
      report(tag + " varlen out", e.out);
      report(tag + " varlen state", e.state);
    }
    {
      KdaInputs in = long_memory_inputs();
      const Errors e = check_against_reference(in, kTolOut, kTolState, launch);
      report(tag + " long memory out", e.out);
      report(tag + " long memory state", e.state);
    }
    {
      KdaOptions o;
      o.T = 333, o.H = 2, o.B = 2;
      o.gate = GateForm::kPrecomputed, o.g_min = -1000, o.g_max = 0, o.g_dtype = DType::kF32, o.with_dt_bias = false;
      o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
      KdaInputs in(o);
      const Errors e = check_against_reference(in, kTolOut, kTolState, launch);
      report(tag + " precomputed [-1000, 0] out", e.out);
      report(tag + " precomputed [-1000, 0] state", e.state);
    }
    {
      KdaInputs in(repeated_key_options(Precision::kPrecise));
      make_repeated_key(in);
      const Errors e = check_against_reference(in, 3e-3, 2e-3, launch);
      report(tag + " repeated key out", e.out);
      report(tag + " repeated key state", e.state);
    }
  }
}

// The fp16 policy's range guard (recur_kernel.cuh RowScale): states far above fp16's 65504 and far
// below its normal range, a jump of 2^36 in |v| within a sequence (the fp32 recomputation of a
// chunk whose fp16 state overflowed) and an initial state of ~2^17, serial and in segments, fp32
// states, slow decay so that the state keeps its scale. Each case runs both precise policies on the
// same inputs: the fp16 one (the rule) within the general bounds and within 1.25x (+1e-4) of the
// split one's error.
TEST_F(PrefillGpu, PreciseRangeGuardMatchesReference) {
  struct Case {
    const char* name;
    double v_scale_first, v_scale_second, state_scale;  // powers of two: exact in bf16 / fp32
  };
  const Case cases[] = {{"v x 2^17", 0x1p17, 0x1p17, 1.0},
                        {"v x 2^-24", 0x1p-24, 0x1p-24, 0x1p-24},
                        {"v x 2^-20 then x 2^16", 0x1p-20, 0x1p16, 0x1p-20},
                        {"initial state x 2^20", 1.0, 1.0, 0x1p20}};
  for (const int64_t seg : {int64_t(-1), int64_t(16)}) {
    for (const Case& c : cases) {
      KdaOptions o;
      o.T = 1500, o.H = 2;
      o.gate = GateForm::kPrecomputed, o.g_min = -0.05, o.g_max = 0, o.g_dtype = DType::kF32, o.with_dt_bias = false;
      o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
      KdaInputs in(o);
      const int64_t per_token = o.H * o.V;
      for (int64_t i = 0; i < in.v.count; ++i)
        in.v.set(i, in.v.get(i) * (i / per_token < o.T / 2 ? c.v_scale_first : c.v_scale_second));
      for (int64_t i = 0; i < in.initial_state.count; ++i) in.initial_state.set(i, in.initial_state.get(i) * c.state_scale);
      const std::string tag = std::string(c.name) + (seg > 0 ? " segments" : " serial");
      const Errors split = check_against_reference(in, kTolOut, kTolState, internal::PrefillLaunch{0, seg, -1});
      const Errors f16 = check_against_reference(in, kTolOut, kTolState, internal::PrefillLaunch{0, seg, 0});
      report(tag + " fp16 out", f16.out);
      report(tag + " fp16 state", f16.state);
      report(tag + " split out", split.out);
      report(tag + " split state", split.state);
      EXPECT_LE(f16.out, 1.25 * split.out + 1e-4) << tag;
      EXPECT_LE(f16.state, 1.25 * split.state + 1e-4) << tag;
    }
  }
}

TEST_F(PrefillGpu, VeryLongSequence131072) {
  KdaOptions o;
  o.T = 131072, o.H = 2;
  o.initial_state = StateKind::kBF16, o.final_state = StateKind::kF32;
  KdaInputs in(o);
  const Errors e = check_against_reference(in);
  report("long131072_out_rel_rms", e.out);
  report("long131072_state_rel_rms", e.state);
}

// Every recurrence variant (value-column split or segments, x precision mode) against the reference.
TEST_F(PrefillGpu, AllRecurrenceVariantsMatchReference) {
  const internal::PrefillLaunch launches[] = {{1, -1}, {2, -1}, {0, 16}, {0, 3}};
  for (const internal::PrefillLaunch& launch : launches) {
    for (const Precision precision : kModes) {
      KdaOptions o;
      o.seqlens = {300, 17, 1024, 77};
      o.H = 4;
      o.precision = precision;
      o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
      KdaInputs in(o);
      const Errors e = check_against_reference(in, kTolOut, kTolState, launch);
      const std::string name = std::string("variant_splits") + std::to_string(launch.v_splits) + "_segments" +
                               std::to_string(launch.segment_chunks) + "_" + precision_name(precision);
      report(name + "_out", e.out);
      report(name + "_state", e.state);
    }
  }
}

TEST_F(PrefillGpu, RepeatRunsAreBitIdentical) {
  KdaOptions o;
  o.seqlens = {700, 33, 2048};
  o.H = 8;
  o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
  KdaInputs in(o);
  DeviceProblem dev(in);
  std::vector<unsigned char> out0, fin0;
  for (int rep = 0; rep < 3; ++rep) {
    dev.poison();
    dev.run();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    dev.download();
    if (rep == 0) {
      out0 = in.out.bytes, fin0 = in.final_state.bytes;
    } else {
      EXPECT_TRUE(out0 == in.out.bytes) << "out differs on repeat " << rep;
      EXPECT_TRUE(fin0 == in.final_state.bytes) << "final_state differs on repeat " << rep;
    }
  }
}

TEST_F(PrefillGpu, CudaGraphCaptureAndReplayMatchesEagerRun) {
  KdaOptions o;
  o.seqlens = {100, 0, 513};
  o.H = 4;
  o.initial_state = StateKind::kF32, o.final_state = StateKind::kBF16;
  KdaInputs in(o);
  DeviceProblem dev(in);
  dev.poison();
  dev.run();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  dev.download();
  const auto eager_out = in.out.bytes, eager_fin = in.final_state.bytes;

  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  dev.poison();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  dev.run(stream);  // must not synchronise or allocate: capture would fail
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 2; ++i) CUDA_OK(cudaGraphLaunch(exec, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  dev.download();
  EXPECT_TRUE(eager_out == in.out.bytes);
  EXPECT_TRUE(eager_fin == in.final_state.bytes);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// cu_seqlens cannot be read on the host without a sync: the kernels check it and fill the
// outputs with NaN instead of computing garbage.
// Three sequences whose device cu_seqlens decreases at entry 2, outputs zeroed first: after the
// call every element of out and final_state is NaN.
void expect_bad_cu_seqlens_poison_outputs(const std::vector<int64_t>& seqlens, internal::PrefillLaunch launch) {
  KdaOptions o;
  o.seqlens = seqlens;
  o.H = 2;
  o.final_state = StateKind::kF32;
  KdaInputs in(o);
  in.cu_seqlens.set(2, 10.0);  // below cu_seqlens[1]: decreasing
  DeviceProblem dev(in, launch);
  cudaMemset(dev.out, 0, in.out.data_bytes());
  cudaMemset(dev.fin, 0, in.final_state.data_bytes());
  dev.run();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  dev.download();
  EXPECT_EQ(count_nonfinite(in.out.values()), in.out.count);
  EXPECT_EQ(count_nonfinite(in.final_state.values()), in.final_state.count);
}

TEST_F(PrefillGpu, InvalidDeviceCuSeqlensPoisonsOutputsWithNaN) {
  expect_bad_cu_seqlens_poison_outputs({40, 30, 20}, {});  // 0, 40, 10, 90
}

TEST_F(PrefillGpu, BadArgumentsThrowBeforeAnyWork) {
  KdaOptions o;
  o.T = 32, o.H = 2;
  o.dtype = DType::kBF16;
  KdaInputs in(o);
  DeviceProblem dev(in);
  PrefillParams p = dev.params();
  p.K = 64;  // only K = V = 128 on the GPU
  EXPECT_THROW(forward(p, dev.workspace->ptr, dev.workspace->bytes, nullptr), Error);
  p = dev.params();
  EXPECT_THROW(forward(p, dev.workspace->ptr, 0, nullptr), Error);  // workspace too small
  p.pre.lower_bound = -6.0f;
  EXPECT_THROW(forward(p, dev.workspace->ptr, dev.workspace->bytes, nullptr), Error);
  // The kernels use 8- and 16-byte vector accesses: misaligned tensors are rejected by name.
  p = dev.params();
  p.q = static_cast<const uint8_t*>(p.q) + 2;
  expect_invalid([&] { forward(p, dev.workspace->ptr, dev.workspace->bytes, nullptr); }, "q must be 16-byte aligned");
  p = dev.params();
  p.out = static_cast<uint8_t*>(p.out) + 8;
  expect_invalid([&] { forward(p, dev.workspace->ptr, dev.workspace->bytes, nullptr); }, "out must be 16-byte aligned");
  p = dev.params();
  EXPECT_THROW(forward(p, static_cast<uint8_t*>(dev.workspace->ptr) + 4, dev.workspace->bytes - 4, nullptr), Error);
  // Every tensor must live where q does: pageable host memory next to a device q is named, as is
  // a device tensor next to a host q (which runs the CPU backend); nothing is written.
  std::vector<uint8_t> host_k(in.k.bytes.size()), host_out(in.out.bytes.size());
  p = dev.params();
  p.k = host_k.data();
  expect_invalid([&] { forward(p, dev.workspace->ptr, dev.workspace->bytes, nullptr); },
                 "k is pageable host memory but q is on the GPU");
  p = dev.params();
  p.out = host_out.data();
  expect_invalid([&] { forward(p, dev.workspace->ptr, dev.workspace->bytes, nullptr); },
                 "out is pageable host memory but q is on the GPU");
  p = dev.params();
  std::vector<uint8_t> ws_host(dev.workspace->bytes + 16);
  expect_invalid([&] { forward(p, ws_host.data() + (16 - reinterpret_cast<uintptr_t>(ws_host.data()) % 16) % 16,
                               dev.workspace->bytes, nullptr); },
                 "workspace is pageable host memory");
  p = in.params();  // host tensors: the CPU backend, which cannot read a device tensor
  p.v = dev.v;
  expect_invalid([&] { forward(p, nullptr, 0, nullptr); }, "v is device memory (device ");
  EXPECT_TRUE(std::all_of(host_out.begin(), host_out.end(), [](uint8_t b) { return b == 0; }));
  dev.download();
  EXPECT_EQ(in.out.bytes, std::vector<unsigned char>(in.out.bytes.size(), kPoison)) << "out written despite errors";
}

// Corrupted PrefillParams on the GPU (tests/cpp/fuzz_params.h, plus what only the GPU path has:
// misaligned and pageable host pointers, a bad workspace, bad cu_seqlens values in device memory).
// Every call runs or throws before writing; nothing ever faults: the device stays usable after
// every case (a kernel fault would be sticky). Bad device cu_seqlens values are the kernels' to
// catch: they poison out and final_state with NaN (InvalidDeviceCuSeqlensPoisonsOutputsWithNaN).
TEST_F(PrefillGpu, CorruptedParamsRunOrThrowAndNeverFault) {
  Fuzz f;
  int refused = 0;
  constexpr int kGpuCases = 150;
  std::vector<uint8_t> pageable(1 << 20);
  for (int c = 0; c < kGpuCases; ++c) {
    KdaInputs in(f.prefill_problem(40));  // K = V = 128, bf16: the GPU's
    DeviceProblem dev(in);
    dev.poison();
    PrefillParams p = dev.params();
    const PrefillParams p0 = p;
    void* ws = dev.workspace->ptr;
    size_t ws_bytes = dev.workspace->bytes;
    HostTensor cu = in.cu_seqlens;
    std::unique_ptr<DeviceBuffer> bad_cu;
    std::string what = in.describe() + " |";
    for (int64_t m = 1 + f.below(2); m > 0; --m) {
      switch (f.below(10)) {
        case 0:  // invalid here (never a valid dtype of another size: the kernels would read past a buffer)
          if (f.below(2)) p.dtype = f.pick({DType::kF32, DType::kI32, static_cast<DType>(77)}), what += " dtype";
          else p.g_dtype = f.bad_float_dtype(), what += " g_dtype";
          break;
        case 1: f.null_pointer(p, what); break;
        case 2: f.corrupt_batch(p, p0, what); break;
        case 3: (f.below(2) ? p.K : p.V) = f.pick<int64_t>({64, 0, 256}), what += " K/V"; break;
        case 4: {  // misaligned: 2 bytes into the same buffer (the kernels need 16)
          const void** ptrs[] = {&p.q, &p.k, &p.v, &p.g};
          const void*& x = *ptrs[f.below(4)];
          if (x != nullptr) x = static_cast<const uint8_t*>(x) + 2, what += " misaligned";
          break;
        }
        case 5: {  // pageable host memory where device memory belongs
          const void** ptrs[] = {&p.k, &p.v, &p.g, &p.beta, &p.cu_seqlens, &p.initial_state};
          const void*& x = *ptrs[f.below(6)];
          if (x != nullptr) x = pageable.data(), what += " a host tensor";
          else if (f.below(2)) p.out = pageable.data(), what += " host out";
          else ws = pageable.data(), what += " host workspace";
          break;
        }
        case 6:
          switch (f.below(3)) {
            case 0: ws = nullptr, what += " workspace=null"; break;
            case 1: ws_bytes /= 2, what += " workspace too small"; break;
            default: ws = static_cast<uint8_t*>(ws) + 8, ws_bytes -= 8, what += " workspace misaligned";
          }
          break;
        case 7:
          if (p.cu_seqlens == nullptr) break;
          if (f.below(3) == 0) {
            p.num_seqs = f.pick<int64_t>({-1, f.below(in.N + 1)}), what += " num_seqs";
          } else {  // bad values in device memory: the kernels flag them and poison the outputs
            f.corrupt_cu(cu, in.N + 1, what);
            bad_cu = std::make_unique<DeviceBuffer>(cu.bytes.size());
            ASSERT_EQ(cudaMemcpy(bad_cu->ptr, cu.bytes.data(), cu.bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
            p.cu_seqlens = bad_cu->ptr;
          }
          break;
        case 8: p.precision = static_cast<Precision>(f.pick({5, -1})), what += " precision"; break;
        default: f.corrupt_gate(p.pre, what);
      }
    }
    SCOPED_TRACE(what);
    if (run([&] { forward(p, ws, ws_bytes, nullptr); }, what) == Outcome::kRefused) {
      ++refused;
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      dev.download();
      EXPECT_EQ(in.out.bytes, std::vector<unsigned char>(in.out.bytes.size(), kPoison)) << "out written";
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << "the call faulted";
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    if (HasFailure()) break;
  }
  EXPECT_GT(refused, kGpuCases / 3);
  EXPECT_LT(refused, kGpuCases);
}

// ---- Segments: one sequence cut into pieces that run at once (docs/DESIGN.md "Segments") ----------

internal::PrefillLaunch segments(int64_t chunks) { return {0, chunks}; }
constexpr internal::PrefillLaunch kSerial{0, -1};

TEST_F(PrefillGpu, SegmentsOddLengthsAllStateCombinations) {
  const StateKind kinds[] = {StateKind::kNone, StateKind::kF32, StateKind::kBF16};
  for (int64_t T : {0, 1, 16, 17, 33, 100, 1000}) {
    for (int64_t chunks : {1, 2, 5}) {
      for (StateKind init : kinds) {
        for (StateKind fin : kinds) {
          if (T != 100 && (init != StateKind::kF32 || fin != StateKind::kF32)) continue;
          KdaOptions o;
          o.B = 2, o.T = T, o.H = 3;
          o.initial_state = init, o.final_state = fin;
          KdaInputs in(o);
          SCOPED_TRACE("segments of " + std::to_string(chunks) + " chunks");
          check_against_reference(in, kTolOut, kTolState, segments(chunks));
        }
      }
    }
  }
}

TEST_F(PrefillGpu, SegmentsVarlenWithEmptySequences) {
  for (DType cu : {DType::kI32, DType::kI64}) {
    for (int64_t chunks : {1, 4, 16, 0}) {  // 0: the launcher's rule (it splits at H = 4)
      KdaOptions o;
      o.seqlens = {0, 300, 17, 0, 1024, 77, 1, 0, 16, 513};
      o.cu_dtype = cu;
      o.H = 4;
      o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
      KdaInputs in(o);
      SCOPED_TRACE("segments of " + std::to_string(chunks) + " chunks");
      const Errors e = check_against_reference(in, kTolOut, kTolState, segments(chunks));
      report("segments" + std::to_string(chunks) + "_varlen_out", e.out);
      report("segments" + std::to_string(chunks) + "_varlen_state", e.state);
    }
  }
}

// Small enough for compute-sanitizer (scripts/gpu_check.sh sanitize): every kernel of the
// segmented path, varlen with an empty sequence, both precisions.
TEST_F(PrefillGpu, SegmentsSmallForSanitizers) {
  for (const Precision precision : kModes) {
    KdaOptions o;
    o.seqlens = {0, 100, 17, 300};
    o.H = 2;
    o.precision = precision;
    o.initial_state = StateKind::kF32, o.final_state = StateKind::kBF16;
    KdaInputs in(o);
    check_against_reference(in, kTolOut, kTolState, segments(2));
  }
}

// The segment rule is the same in every precision mode: the fast mode's former threshold (three
// segments' worth of fill a sequence) left it serial at H = 27-44 with one sequence on 132 SMs,
// 1.84x slower than segmented at T=32768 H=32 (run 51).
TEST_F(PrefillGpu, SegmentRuleIsTheSameInEveryMode) {
  for (const int64_t H : {2, 12, 16, 24, 32, 40, 64, 96})
    for (const int64_t T : {2048, 32768}) {
      PrefillParams p;
      p.B = 1, p.T = T, p.H = H;
      const int64_t precise = internal::chosen_segment_chunks(p);
      for (const Precision mode : {Precision::kBalanced, Precision::kFast}) {
        p.precision = mode;
        EXPECT_EQ(internal::chosen_segment_chunks(p), precise) << precision_name(mode) << " T=" << T << " H=" << H;
      }
    }
  PrefillParams p;
  p.B = 1, p.T = 32768, p.H = 32, p.precision = Precision::kFast;
  EXPECT_GT(internal::chosen_segment_chunks(p), 0) << "T=32768 H=32 in the fast mode runs serially";
}

// The default launch splits few-head problems: check that it did, and that the split and the
// serial recurrence agree on the same inputs within the bf16 rounding of the output.
TEST_F(PrefillGpu, SegmentsAgreeWithTheSerialRecurrence) {
  KdaOptions o;
  o.T = 4096, o.H = 2;
  o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
  KdaInputs in(o);
  EXPECT_GT(internal::chosen_segment_chunks(in.params()), 0) << "the launcher no longer splits T=4096, H=2";
  const Reference ref = run_reference(in);
  auto run = [&](internal::PrefillLaunch launch) {
    DeviceProblem dev(in, launch);
    dev.poison();
    dev.run();
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    dev.download();
    return std::make_pair(in.out.values(), in.final_state.values());
  };
  const auto serial = run(kSerial);
  const auto split = run({});
  const double d_out = rel_rms(split.first, serial.first), d_state = rel_rms(split.second, serial.second);
  report("segments_vs_serial_out", d_out);
  report("segments_vs_serial_state", d_state);
  EXPECT_LE(d_out, 4e-3);
  EXPECT_LE(d_state, 1e-4);
  const double e_serial = rel_rms(serial.first, ref.out), e_split = rel_rms(split.first, ref.out);
  report("segments_out_rel_rms", e_split);
  report("serial_out_rel_rms", e_serial);
  EXPECT_LE(e_split, 1.1 * e_serial + 1e-4);
  EXPECT_LE(rel_rms(split.second, ref.final_state), 1.5 * rel_rms(serial.second, ref.final_state) + 1e-6);
}

// The transition-skipping rule on this GPU (launch.cu choose_run_chunks): where the exact path's
// segments have room for two pieces each or more in one wave of the warpgroup slots (seg_ctas_per_sm
// * #SMs: three CTAs an SM from H = 16 up, else two; slots / 2H pieces a head), equal pieces of 32
// chunks or more; elsewhere pieces of chunks * 2H / slots rounded up to 32 within [32, 64], or one
// piece a segment where the segment is shorter. Pinned for the H200's 132 SMs at the few-head shapes.
TEST_F(PrefillGpu, SkipRuleCutsSegmentsIntoEqualPieces) {
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  struct Shape {
    int64_t T, H, seg, run;  // seg, run: the rule's on 132 SMs
  };
  for (const Shape s : {Shape{65536, 16, 683, 344}, Shape{32768, 32, 683, 344}, Shape{131072, 32, 2731, 1368},
                        Shape{8192, 12, 86, 64}, Shape{32768, 12, 342, 64}, Shape{2048, 12, 22, 24}}) {
    PrefillParams p;  // the shape fields are all the rule reads
    p.B = 1, p.T = s.T, p.H = s.H;
    const int64_t seg = internal::chosen_segment_chunks(p), run = internal::chosen_run_chunks(p);
    ASSERT_GT(seg, 0) << "T=" << s.T << " H=" << s.H;
    const int64_t slots = (s.H >= 16 ? 3 : 2) * int64_t(sms);
    const int64_t chunks = s.T / 16, per_segment = (slots / (2 * s.H)) / ((chunks + seg - 1) / seg);
    if (per_segment >= 2 && seg >= 32 * per_segment) {
      EXPECT_EQ(run, ((seg + per_segment - 1) / per_segment + 7) / 8 * 8) << "T=" << s.T << " H=" << s.H;
    } else {
      // pieces of 32 or 64 chunks, or one piece a segment (rounded up to the combine's tiles)
      EXPECT_TRUE(run % 8 == 0 && run >= 8 && (run == 32 || run == 64 || (run >= seg && run < seg + 8)))
          << "T=" << s.T << " H=" << s.H << " run " << run << " seg " << seg;
    }
    if (sms == 132) {
      EXPECT_EQ(seg, s.seg) << "T=" << s.T << " H=" << s.H;
      EXPECT_EQ(run, s.run) << "T=" << s.T << " H=" << s.H;
    }
  }
  // No tokens with segments forced (an empty varlen call): no division by its segment count.
  PrefillParams empty;
  empty.B = 1, empty.T = 0, empty.H = 4;
  EXPECT_GE(internal::chosen_run_chunks(empty, internal::PrefillLaunch{0, 8, 0, 0, 1}), 0);
}

// Transition skipping (internal::PrefillLaunch::skip_transitions, docs/DESIGN.md "Segments", runs):
// segments cut into pieces, and a piece whose preceding chunks attenuate any incoming state to 2^-30
// starts from zero that many chunks early. Random lower-bound gates (per head anything from strong
// decay, where pieces skip, to little, where the segments keep their exact run and transition) and
// varlen (one-segment sequences too) match the reference, and differ from the exact segmented call
// (some piece skipped); with long-memory channels no piece can skip and the result is the exact
// call's, bit for bit; a NaN in v reaches every later output of its value column and the final
// state's row, across skipping runs that start after it, as it does in the recurrence.
// NaN outputs of a call with a NaN in v at token t0, head h0, value column c0: `missing`, the
// outputs of that column from t0 on that are not NaN; `spurious`, NaN outputs before t0 or in the
// other heads; `other_columns`, NaN outputs of head h0 from t0 on in other columns.
struct NanOutputs {
  int64_t missing = 0, spurious = 0, other_columns = 0;
};
NanOutputs run_with_nan(KdaInputs& in, const internal::PrefillLaunch& launch, int64_t t0, int64_t h0, int64_t c0) {
  const KdaOptions& o = in.opt;
  in.v.set((t0 * o.H + h0) * o.V + c0, std::nan(""));
  DeviceProblem dev(in, launch);
  dev.poison();
  dev.run();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  dev.download();
  NanOutputs r;
  for (int64_t t = 0; t < o.T; ++t)
    for (int64_t h = 0; h < o.H; ++h)
      for (int64_t c = 0; c < o.V; ++c) {
        const bool nan = std::isnan(in.out.get((t * o.H + h) * o.V + c));
        if (t < t0 || h != h0) r.spurious += nan;
        else if (c == c0) r.missing += !nan;
        else r.other_columns += nan;
      }
  return r;
}

TEST_F(PrefillGpu, SegmentsSkipTransitionsMatchReference) {
  // Segments of 32 chunks in pieces of 8, warm-ups of up to 8 chunks (the rule: a piece); and
  // segments of one piece (8 chunks), where a segment s > 0 whose start skips has no exact run and
  // no transition at all.
  internal::PrefillLaunch skip{0, 32, 0, 0, 1}, exact{0, 32, 0, 0, -1};
  skip.skip_run_chunks = 8;
  internal::PrefillLaunch skip1{0, 8, 0, 0, 1}, exact1{0, 8, 0, 0, -1};
  skip1.skip_run_chunks = 8;
  auto run = [&](KdaInputs& in, const internal::PrefillLaunch& launch) {
    const Errors e = check_against_reference(in, kTolOut, kTolState, launch);
    return std::make_pair(e, std::make_pair(in.out.bytes, in.final_state.bytes));
  };
  {
    KdaOptions o;
    o.seqlens = {300, 17, 1024, 77, 2000};
    o.H = 4;
    o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
    KdaInputs in(o);
    in.A_log[0] = in.A_log[1] = -1.0f;  // heads 0, 1: ~-1 per token on every channel (they skip)
    in.A_log[2] = in.A_log[3] = 1.0f;   // heads 2, 3: some channel near -1e-4 per token (they cannot)
    const auto [e_exact, bits_exact] = run(in, exact);
    const auto [e_skip, bits_skip] = run(in, skip);
    report("skip transitions random varlen out", e_skip.out);
    report("skip transitions random varlen state", e_skip.state);
    report("exact transitions random varlen out", e_exact.out);
    EXPECT_LE(e_skip.out, 1.05 * e_exact.out + 1e-5);
    EXPECT_LE(e_skip.state, 1.05 * e_exact.state + 1e-5);
    EXPECT_FALSE(bits_skip == bits_exact) << "no piece took the skipped path";
    const auto [e_exact1, bits_exact1] = run(in, exact1);
    const auto [e_skip1, bits_skip1] = run(in, skip1);
    report("skip transitions one-piece segments random varlen out", e_skip1.out);
    report("skip transitions one-piece segments random varlen state", e_skip1.state);
    EXPECT_LE(e_skip1.out, 1.05 * e_exact1.out + 1e-5);
    EXPECT_LE(e_skip1.state, 1.05 * e_exact1.state + 1e-5);
    EXPECT_FALSE(bits_skip1 == bits_exact1) << "no one-piece segment skipped its transition";
  }
  {
    KdaInputs in = long_memory_inputs();
    const auto [e_exact, bits_exact] = run(in, exact);
    const auto [e_skip, bits_skip] = run(in, skip);
    report("skip transitions long memory out", e_skip.out);
    EXPECT_TRUE(bits_skip == bits_exact) << "a long-memory piece skipped its transition";
    const auto [e_exact1, bits_exact1] = run(in, exact1);
    const auto [e_skip1, bits_skip1] = run(in, skip1);
    EXPECT_TRUE(bits_skip1 == bits_exact1) << "a long-memory one-piece segment skipped its transition";
  }
  {  // 47 segments of 8 chunks: the chain reads the plans of segments 32 on from global memory (it
     // loads the first 32 into shared memory up front)
    KdaInputs longer = long_memory_inputs(6000);
    const auto [e_exact1, bits_exact1] = run(longer, exact1);
    const auto [e_skip1, bits_skip1] = run(longer, skip1);
    report("skip transitions long memory 47 segments out", e_skip1.out);
    EXPECT_TRUE(bits_skip1 == bits_exact1) << "a long-memory segment past the 32nd skipped its transition";
  }
  // Strong decay everywhere: every piece but a sequence's first skips. T = 2000 is four segments, 500
  // one (the chain's one-segment path). The NaN at the first token of a chunk (the chunk's products
  // carry a NaN to its earlier tokens too), head 1, value column 37: chunk 6 ends the first segment's
  // exact run (the next piece's warm-up of one chunk does not see it), chunk 2 likewise in the
  // one-segment sequence, chunk 40 lies inside the second segment's second piece, a skipping run.
  // Then the same with one-piece segments (every segment s > 0 one skipping run, no exact run).
  struct NanCase {
    int64_t T, t0;
    const internal::PrefillLaunch& launch;
  };
  // Last, a NaN in the 36th of 47 one-piece segments (T = 6000; the chain's plans past the 32nd from
  // global memory).
  for (const NanCase nc : {NanCase{2000, 96, skip}, NanCase{2000, 640, skip}, NanCase{500, 32, skip},
                           NanCase{2000, 96, skip1}, NanCase{2000, 640, skip1}, NanCase{6000, 4576, skip1}}) {
    KdaOptions o;
    o.T = nc.T, o.H = 2;
    o.A_log_min = 0.5, o.A_log_max = 1, o.dt_bias_min = 4, o.dt_bias_max = 5;
    o.final_state = StateKind::kF32;
    KdaInputs in(o);
    const int64_t t0 = nc.t0, c0 = 37, h0 = 1;
    const NanOutputs r = run_with_nan(in, nc.launch, t0, h0, c0);
    EXPECT_EQ(r.missing, 0) << "T=" << nc.T << " NaN at " << t0 << ": outputs after the NaN that are not NaN";
    EXPECT_EQ(r.spurious, 0) << "T=" << nc.T << " NaN at " << t0 << ": NaN outputs before it or in the other head";
    int64_t state_missing = 0, state_spurious = 0;
    for (int64_t h = 0; h < o.H; ++h)
      for (int64_t v = 0; v < o.V; ++v)
        for (int64_t k = 0; k < o.K; ++k) {
          const bool nan = !std::isfinite(in.final_state.get(((h * o.V) + v) * o.K + k));
          if (h == h0 && v == c0) state_missing += !nan;
          else state_spurious += nan;
        }
    EXPECT_EQ(state_missing, 0) << "T=" << nc.T << " NaN at " << t0 << ": the final state's row is finite";
    EXPECT_EQ(state_spurious, 0) << "T=" << nc.T << " NaN at " << t0 << ": NaN in other rows of the final state";
  }
  // Decay in one piece only (chunks 8-15, log-decay -1 per token; ~0 elsewhere): the first segment's
  // exact run (chunks 0-15) holds the NaN of token 0, the skipping run from chunk 16 does not see
  // it, and the second segment, which cannot skip, is one exact run that the combine finishes
  // from X_1: its outputs in the NaN's column must be NaN too.
  {
    KdaOptions o;
    o.T = 2048, o.H = 2;
    o.gate = GateForm::kPrecomputed, o.with_dt_bias = false, o.g_min = -1e-3, o.g_max = 0, o.g_dtype = DType::kF32;
    o.final_state = StateKind::kF32;
    KdaInputs in(o);
    for (int64_t t = 128; t < 256; ++t)
      for (int64_t i = 0; i < o.H * o.K; ++i) in.g.set(t * o.H * o.K + i, -1.0);
    const NanOutputs r = run_with_nan(in, skip, 0, 1, 37);
    EXPECT_EQ(r.missing, 0) << "decay in one piece: outputs of the NaN's column that are not NaN";
    EXPECT_EQ(r.spurious + r.other_columns, 0) << "decay in one piece: NaN outputs in other columns";
  }
}

// Low-rank transitions (internal::PrefillLaunch::lowrank_transitions; docs/DESIGN.md "Long memory: the
// transition is low rank"): with long memory every segment s > 0 carries T G (8 kept channels and one
// chunk's 16 columns) instead of the K transition rows, as accurate as the exact transition; where
// every channel decays fast the segments' starts skip and the path is not taken; a NaN in v still
// reaches every later output of its column (through B_s into X_{s+1} and Y_{s+1} = G X_{s+1}: the
// K-wide and the low-rank halves of the combine in later segments).
TEST_F(PrefillGpu, SegmentsLowRankTransitionsMatchReference) {
  internal::PrefillLaunch exact;
  exact.segment_chunks = 32, exact.skip_transitions = 1, exact.skip_run_chunks = 8, exact.seg_ctas_per_sm = 2;
  internal::PrefillLaunch lowrank = exact;
  lowrank.lowrank_transitions = 1;
  auto run = [&](KdaInputs& in, const internal::PrefillLaunch& launch) {
    const Errors e = check_against_reference(in, kTolOut, kTolState, launch);
    return std::make_pair(e, std::make_pair(in.out.bytes, in.final_state.bytes));
  };
  for (const Precision mode : kModes) {
    KdaInputs in = long_memory_inputs();  // T = 3000: 6 segments of 512 tokens
    in.opt.precision = mode;
    const auto [e_exact, bits_exact] = run(in, exact);
    const auto [e_low, bits_low] = run(in, lowrank);
    const std::string name = std::string("lowrank transitions long memory ") + precision_name(mode);
    report(name + " out", e_low.out);
    report(name + " state", e_low.state);
    EXPECT_LE(e_low.out, 1.05 * e_exact.out + 1e-5) << precision_name(mode);
    EXPECT_LE(e_low.state, 1.05 * e_exact.state + 1e-5) << precision_name(mode);
    EXPECT_FALSE(bits_low == bits_exact) << "no segment took the low-rank path, " << precision_name(mode);
  }
  {  // varlen with an empty and a short sequence, bf16 states, long memory in one head only
    KdaOptions o;
    o.seqlens = {1500, 0, 17, 2100};
    o.H = 3;
    o.A_log_min = 0, o.A_log_max = 1, o.dt_bias_min = 0, o.dt_bias_max = 1;
    o.initial_state = StateKind::kBF16, o.final_state = StateKind::kBF16;
    KdaInputs in(o);
    for (int64_t c = 0; c < 8; ++c) in.dt_bias[1 * o.K + c] = -8.0f;
    const auto [e_exact, bits_exact] = run(in, exact);
    const auto [e_low, bits_low] = run(in, lowrank);
    report("lowrank transitions varlen out", e_low.out);
    EXPECT_LE(e_low.out, 1.05 * e_exact.out + 1e-5);
    EXPECT_LE(e_low.state, 1.05 * e_exact.state + 1e-5);
    EXPECT_FALSE(bits_low == bits_exact) << "no segment took the low-rank path";
  }
  {  // fast decay everywhere: the starts skip, nothing changes
    KdaOptions o;
    o.T = 2000, o.H = 2;
    o.A_log_min = 0.5, o.A_log_max = 1, o.dt_bias_min = 4, o.dt_bias_max = 5;
    o.final_state = StateKind::kF32;
    KdaInputs in(o);
    const auto [e_exact, bits_exact] = run(in, exact);
    const auto [e_low, bits_low] = run(in, lowrank);
    EXPECT_TRUE(bits_low == bits_exact) << "fast decay: the low-rank option changed the bits";
  }
  // NaN in v, head 1, column 37, at a chunk's first token (a chunk's products carry it to its earlier
  // tokens too): segment 1's first chunk (token 512), its fourth (560), segment 3 (1600).
  for (const int64_t t0 : {512, 560, 1600}) {
    KdaInputs in = long_memory_inputs();
    const NanOutputs r = run_with_nan(in, lowrank, t0, 1, 37);
    EXPECT_EQ(r.missing, 0) << "NaN at " << t0 << ": outputs after it in its column that are not NaN";
    EXPECT_EQ(r.spurious, 0) << "NaN at " << t0 << ": NaN outputs before it or in the other head";
  }
}

// log ||A||_2 of each chunk's state transition (S_out = A S_in + B, A = prod_t (I - b_t k_t k_t^T)
// diag(e^{a_t}) over the chunk's tokens) at each head, in fp64 from the same inputs: [chunk][H] for
// B sequences of T tokens. The norm by power iteration on A^T A, which converges from below, so a
// bound under it is a bound under the norm.
std::vector<double> chunk_transition_log_norms(KdaInputs& in) {
  const PrefillParams p = in.params();
  const int64_t K = p.K, H = p.H, chunks = (p.T + kChunk - 1) / kChunk;
  std::vector<double> out(size_t(p.B * chunks * H));
  std::vector<double> q(K), k(K), v(p.V), decay(K), A(K * K), x(K), y(K);
  std::mt19937_64 rng(in.seed);
  std::normal_distribution<double> normal;
  for (int64_t h = 0; h < H; ++h) {
    const host::HeadGate<double> gate(p.pre, h, K);
    for (int64_t n = 0; n < p.B; ++n)
      for (int64_t c = 0; c < chunks; ++c) {
        std::fill(A.begin(), A.end(), 0.0);
        for (int64_t i = 0; i < K; ++i) A[i * K + i] = 1.0;
        for (int64_t t = n * p.T + c * kChunk; t < std::min(n * p.T + (c + 1) * kChunk, (n + 1) * p.T); ++t) {
          const double b = host::load_token(p, gate, t, h, q.data(), k.data(), v.data(), decay.data());
          for (int64_t i = 0; i < K; ++i)
            for (int64_t j = 0; j < K; ++j) A[i * K + j] *= decay[i];
          std::fill(y.begin(), y.end(), 0.0);  // y = k^T A
          for (int64_t i = 0; i < K; ++i)
            for (int64_t j = 0; j < K; ++j) y[j] += k[i] * A[i * K + j];
          for (int64_t i = 0; i < K; ++i)
            for (int64_t j = 0; j < K; ++j) A[i * K + j] -= b * k[i] * y[j];
        }
        for (double& e : x) e = normal(rng);
        double sigma2 = 0.0;
        for (int it = 0; it < 100; ++it) {
          double nx = 0.0;
          for (double e : x) nx += e * e;
          nx = std::sqrt(nx);
          if (!(nx > 0.0)) break;
          for (double& e : x) e /= nx;
          std::fill(y.begin(), y.end(), 0.0);  // y = A x, x = A^T y
          for (int64_t i = 0; i < K; ++i)
            for (int64_t j = 0; j < K; ++j) y[i] += A[i * K + j] * x[j];
          double ny = 0.0;
          for (double e : y) ny += e * e;
          sigma2 = std::max(sigma2, ny);
          std::fill(x.begin(), x.end(), 0.0);
          for (int64_t i = 0; i < K; ++i)
            for (int64_t j = 0; j < K; ++j) x[j] += A[i * K + j] * y[i];
        }
        out[size_t((n * chunks + c) * H + h)] = 0.5 * std::log(sigma2);
      }
  }
  return out;
}

// K1's chunk bounds (internal::chunk_log_bounds) for `in` under `launch`, [chunk][H].
std::vector<float> gpu_chunk_log_bounds(KdaInputs& in, const internal::PrefillLaunch& launch) {
  DeviceProblem dev(in);
  const PrefillParams p = dev.params();
  const int64_t slots = p.B * ((p.T + kChunk - 1) / kChunk) * p.H;
  DeviceBuffer bounds(size_t(slots) * 4), ws(internal::chunk_log_bounds_workspace_size(p));
  cudaMemset(bounds.ptr, kPoison, bounds.bytes);
  internal::chunk_log_bounds(p, launch, static_cast<float*>(bounds.ptr), ws.ptr, ws.bytes);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> result(static_cast<size_t>(slots));
  cudaMemcpy(result.data(), bounds.ptr, bounds.bytes, cudaMemcpyDeviceToHost);
  return result;
}

// Transition skipping drops an incoming state only where the product of K1's chunk bounds says
// it is below 2^-30 of the state there, so each bound must hold: bound >= log ||A||_2 of the
// chunk's transition, on every kind of input (both bounds, internal::PrefillLaunch::skip_bound).
// On random gates the rule's bound (the smaller of the token bound and the chunk's own) must
// also be far tighter than the token bound alone: that is what lets random gates skip after one
// or two chunks of warm-up instead of tens.
TEST_F(PrefillGpu, ChunkBoundsBoundEveryChunkTransition) {
  struct Case {
    std::string name;
    std::function<void(KdaOptions&)> options;
    std::function<void(KdaInputs&)> edit;
  };
  auto nothing = [](KdaInputs&) {};
  const std::vector<Case> cases = {
      {"random gates", [](KdaOptions& o) { o.A_log_min = 0, o.A_log_max = 1, o.dt_bias_min = 0, o.dt_bias_max = 1; },
       nothing},
      {"slow heads (A_log 1)", [](KdaOptions& o) { o.A_log_min = o.A_log_max = 1; }, nothing},
      {"long memory",
       [](KdaOptions& o) { o.A_log_min = 0, o.A_log_max = 1, o.dt_bias_min = 0, o.dt_bias_max = 1; },
       [](KdaInputs& in) {
         for (int64_t h = 0; h < in.opt.H; ++h)
           for (int64_t c = 0; c < 8; ++c) in.dt_bias[h * in.opt.K + c] = -8.0f;
       }},
      {"uniform decay -0.1", [](KdaOptions& o) {
         o.gate = GateForm::kPrecomputed, o.with_dt_bias = false, o.g_min = o.g_max = -0.1, o.g_dtype = DType::kF32;
       }, nothing},
      {"precomputed to -1000", [](KdaOptions& o) {
         o.gate = GateForm::kPrecomputed, o.with_dt_bias = false, o.g_min = -1000, o.g_max = 0, o.g_dtype = DType::kF32;
       }, nothing},
      {"softplus +-8", [](KdaOptions& o) {
         o.gate = GateForm::kSoftplus, o.g_min = -8, o.g_max = 8, o.dt_bias_min = -8, o.dt_bias_max = 8;
       }, nothing},
      {"repeated key", [](KdaOptions& o) { o.beta_min = o.beta_max = 8; }, make_repeated_key},
      {"no L2 norm, |k| 2, beta in [0, 1] (expanding)", [](KdaOptions& o) {
         o.l2norm = false, o.beta_is_logit = false;
       }, [](KdaInputs& in) {
         for (int64_t i = 0; i < in.k.count; ++i) in.k.set(i, 2.0 * in.k.get(i));
       }},
  };
  double random_rule = 0, random_token = 0;
  for (const Case& c : cases) {
    KdaOptions o;
    o.T = 1000, o.H = 2;
    c.options(o);
    KdaInputs in(o);
    c.edit(in);
    const std::vector<double> exact = chunk_transition_log_norms(in);
    internal::PrefillLaunch token{};
    token.skip_bound = -1;
    const std::vector<float> rule = gpu_chunk_log_bounds(in, {}), former = gpu_chunk_log_bounds(in, token);
    double slack_rule = 0, slack_token = 0;
    int violations = 0;
    for (size_t i = 0; i < exact.size(); ++i) {
      // 1e-3: the fp32 arithmetic of a bound that is exact where it is tight (the token bound of
      // uniform decay); transition skipping keeps a margin of 2^6 under fp32 rounding.
      if (!(rule[i] >= exact[i] - 1e-3) || !(former[i] >= exact[i] - 1e-3)) {
        if (++violations <= 5)
          ADD_FAILURE() << c.name << ": chunk slot " << i << " log ||A|| " << exact[i] << ", bounds " << rule[i]
                        << " (rule) " << former[i] << " (token) " << in.describe();
      }
      EXPECT_LE(rule[i], former[i]) << c.name << ": the rule's bound is the smaller of the two";
      slack_rule += std::max(-100.0, double(rule[i]) - std::max(-100.0, exact[i]));
      slack_token += std::max(-100.0, double(former[i]) - std::max(-100.0, exact[i]));
    }
    slack_rule /= double(exact.size()), slack_token /= double(exact.size());
    report("chunk bound slack (log), " + c.name + ", rule", slack_rule);
    report("chunk bound slack (log), " + c.name + ", token bound", slack_token);
    EXPECT_EQ(violations, 0) << c.name;
    if (c.name == "random gates") random_rule = slack_rule, random_token = slack_token;
  }
  EXPECT_LT(random_rule + 5.0, random_token) << "the chunk bound is not tighter than the token bound on random gates";
}

// The output and final-state bytes of one launch of `in`, its outputs poisoned first.
std::pair<std::vector<unsigned char>, std::vector<unsigned char>> launch_bits(KdaInputs& in,
                                                                              const internal::PrefillLaunch& launch) {
  DeviceProblem dev(in, launch);
  dev.poison();
  dev.run();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  dev.download();
  return std::make_pair(in.out.bytes, in.final_state.bytes);
}

// Calls f(in, precision) in every mode with inputs of these lengths at H = 4, fp32 states, whose
// head 0 skips its pieces' transitions (the launch-variant tests).
template <class F>
void for_each_mode_with_a_skipping_head(const std::vector<int64_t>& seqlens, F&& f) {
  KdaOptions o;
  o.seqlens = seqlens;
  o.H = 4;
  o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
  for (const Precision precision : kModes) {
    o.precision = precision;
    KdaInputs in(o);
    in.A_log[0] = -1.0f;  // head 0 skips its pieces' transitions
    f(in, precision);
  }
}

// A variant of the segmented K2 (internal::PrefillLaunch::seg_ctas_per_sm) computes what the
// two-CTA kernel computes, bit for bit, on the same segments and pieces (the same arithmetic in the
// same order), exact and skipping, every mode; with its own rules it matches the reference.
void expect_segmented_k2_variant_matches(int ctas_per_sm, const std::vector<int64_t>& seqlens,
                                         const std::string& name) {
  for_each_mode_with_a_skipping_head(seqlens, [&](KdaInputs& in, Precision precision) {
    for (const bool skip : {false, true}) {
      internal::PrefillLaunch two{0, 32, 0, 0, skip ? 1 : -1, skip ? 8 : 0, 0, 2};
      internal::PrefillLaunch variant = two;
      variant.seg_ctas_per_sm = ctas_per_sm;
      EXPECT_TRUE(launch_bits(in, two) == launch_bits(in, variant))
          << name << " " << precision_name(precision) << (skip ? " skipping" : " exact");
    }
    internal::PrefillLaunch rule{};
    rule.seg_ctas_per_sm = ctas_per_sm;
    const Errors e = check_against_reference(in, kTolOut, kTolState, rule);
    report(name + ", the rule, " + precision_name(precision) + " out", e.out);
  });
}

// The three-CTA kernel (168 registers, two stages) plans more segments and pieces under its rules.
TEST_F(PrefillGpu, SegmentedK2AtThreeCtasAnSm) {
  expect_segmented_k2_variant_matches(3, {300, 17, 1024, 77, 2000}, "three CTAs an SM");
}

// The bulk record stream (the rule; internal::PrefillLaunch::record_copy: one bulk copy per
// record) feeds the same arithmetic as the cp.async stream (record_copy = -1): the same bits on
// the same launch, for the two CTAs a head of the serial walk and the segmented K2 at two and
// three CTAs an SM, exact and skipping, every mode.
TEST_F(PrefillGpu, RecordCopyVariantsGiveTheSameBits) {
  internal::PrefillLaunch serial{};
  serial.v_splits = 2, serial.segment_chunks = -1;
  std::vector<std::pair<std::string, internal::PrefillLaunch>> launches{{"two CTAs a head", serial}};
  for (const int ctas : {2, 3})
    for (const bool skip : {false, true})
      launches.emplace_back(std::to_string(ctas) + " CTAs an SM" + (skip ? " skipping" : " exact"),
                            internal::PrefillLaunch{0, 32, 0, 0, skip ? 1 : -1, skip ? 8 : 0, 0, ctas});
  for_each_mode_with_a_skipping_head({300, 17, 1024, 77, 2000, 5}, [&](KdaInputs& in, Precision precision) {
    for (const auto& [name, launch] : launches) {
      internal::PrefillLaunch by_threads = launch;
      by_threads.record_copy = -1;
      const auto expected = launch_bits(in, by_threads);
      for (const int copy : {0, 1}) {
        internal::PrefillLaunch variant = launch;
        variant.record_copy = copy;
        EXPECT_TRUE(launch_bits(in, variant) == expected)
            << name << " record_copy=" << copy << " " << precision_name(precision);
      }
    }
  });
}

// Early launch (internal::PrefillLaunch::early_launch, a candidate: every kernel of the call after
// its first launches while its predecessor runs and waits for it before touching memory) gives
// the bits of stream order (the rule): varlen (K0 first, then K1 launched early), the serial walk
// of one and two CTAs a head, and segments (K2, chain and combine early), exact and skipping,
// every mode.
TEST_F(PrefillGpu, EarlyLaunchGivesTheSameBits) {
  internal::PrefillLaunch two_ctas{}, one_cta{};
  two_ctas.v_splits = 2, two_ctas.segment_chunks = -1;
  one_cta.v_splits = 1, one_cta.segment_chunks = -1;
  const std::vector<std::pair<std::string, internal::PrefillLaunch>> launches{
      {"two CTAs a head", two_ctas},
      {"one CTA a head", one_cta},
      {"segments exact", internal::PrefillLaunch{0, 32, 0, 0, -1, 0, 0, 2}},
      {"segments skipping", internal::PrefillLaunch{0, 32, 0, 0, 1, 8, 0, 3}}};
  for_each_mode_with_a_skipping_head({300, 17, 1024, 77, 2000, 5}, [&](KdaInputs& in, Precision precision) {
    for (const auto& [name, launch] : launches) {
      internal::PrefillLaunch in_order = launch, early = launch;
      in_order.early_launch = 0;
      early.early_launch = 15;
      EXPECT_TRUE(launch_bits(in, early) == launch_bits(in, in_order)) << name << " " << precision_name(precision);
    }
  });
}

TEST_F(PrefillGpu, SegmentsGateFormsAndFlags) {
  struct Case {
    GateForm gate;
    double g_min, g_max, bias;
    bool l2norm, logit, scale;
  };
  const Case cases[] = {
      {GateForm::kLowerBound, -8, 8, 8, true, true, false},  {GateForm::kLowerBound, -8, 8, -8, true, true, false},
      {GateForm::kSoftplus, -8, 8, 8, true, true, false},    {GateForm::kSoftplus, -8, 8, -8, true, true, false},
      {GateForm::kPrecomputed, -1000, 0, 0, true, true, false}, {GateForm::kPrecomputed, -0.05, 0, 0, true, true, false},
      {GateForm::kPrecomputed, -2, 0, 0, false, false, true},  {GateForm::kLowerBound, -3, 3, 1, false, true, true},
  };
  for (const Precision precision : kModes)
    for (const Case& c : cases) {
      KdaOptions o;
      o.T = 333, o.H = 2, o.B = 2;
      o.precision = precision;
      o.gate = c.gate, o.g_min = c.g_min, o.g_max = c.g_max, o.g_dtype = DType::kF32;
      o.dt_bias_min = o.dt_bias_max = c.bias;
      if (c.gate == GateForm::kSoftplus) o.A_log_min = 0, o.A_log_max = 2;
      o.l2norm = c.l2norm, o.beta_is_logit = c.logit;
      o.has_scale = c.scale, o.scale = 0.07f;
      o.beta_dtype = c.logit ? DType::kBF16 : DType::kF32;
      o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
      KdaInputs in(o);
      const Errors e = check_against_reference(in, kTolOut, kTolState, segments(4));
      char range[64];
      std::snprintf(range, sizeof range, " [%g, %g] bias %g", c.g_min, c.g_max, c.bias);
      const std::string label = std::string("segments ") + precision_name(precision) + " " + gate_form_name(c.gate) + range;
      report(label + " out", e.out);
      report(label + " state", e.state);
    }
}

// The adversarial inputs of the precision analysis, cut into 16 segments: one key repeated for
// 16384 tokens (raw gate -12, raw beta 8), and q = k with no decay and beta ~ 1 (T = 4096). The
// segment transitions carry almost all of the state here (no decay), so their rounding shows.
TEST_F(PrefillGpu, SegmentsRepeatedKeyAdversarial) {
  for (const Precision precision : kModes) {
    const bool fast = precision == Precision::kFast;
    {
      KdaInputs in(repeated_key_options(precision));
      make_repeated_key(in);
      // fast: 3.5e-2 / 4.3e-2 measured on the H200 with these 16 segments (the serial fast mode:
      // 8.8e-3 / 1.1e-2): the bf16-rounded transitions compound along the chain on this input, and
      // the level varies with the random inputs (the 32-segment case above: 4.0e-2 .. 6.1e-2).
      const Errors e = fast ? check_against_reference(in, 1e-1, 1e-1, segments(64))
                            : check_against_reference(in, 3e-3, 2e-3, segments(64));
      report(std::string("segments_repeated_key_") + precision_name(precision) + "_out", e.out);
      report(std::string("segments_repeated_key_") + precision_name(precision) + "_state", e.state);
    }
    {
      KdaOptions o;
      o.T = 4096, o.H = 2;
      o.final_state = StateKind::kF32;
      o.precision = precision;
      o.gate = GateForm::kPrecomputed, o.with_dt_bias = false, o.g_min = 0, o.g_max = 0;
      o.beta_min = o.beta_max = 8.0;
      KdaInputs in(o);
      for (int64_t i = 0; i < in.q.count; ++i) in.q.set(i, in.k.get(i));
      // balanced: 2.32e-3 / 2.33e-3 measured on the H200 (the state's bf16 rounding in W, which no
      // decay removes here; precise 2.32e-3 / 1.64e-3), bounded at 3e-3 / 3e-3.
      const bool balanced = precision == Precision::kBalanced;
      const Errors e = fast       ? check_against_reference(in, 2e-2, 2e-2, segments(16))
                       : balanced ? check_against_reference(in, 3e-3, 3e-3, segments(16))
                                  : check_against_reference(in, 3e-3, 2e-3, segments(16));
      report(std::string("segments_q_equals_k_no_decay_") + precision_name(precision) + "_out", e.out);
      report(std::string("segments_q_equals_k_no_decay_") + precision_name(precision) + "_state", e.state);
    }
  }
}

TEST_F(PrefillGpu, SegmentsVeryLongSequence131072) {
  KdaOptions o;
  o.T = 131072, o.H = 2;
  o.initial_state = StateKind::kBF16, o.final_state = StateKind::kF32;
  KdaInputs in(o);
  const Errors e = check_against_reference(in, kTolOut, kTolState, segments(512));
  report("segments_long131072_out_rel_rms", e.out);
  report("segments_long131072_state_rel_rms", e.state);
}

TEST_F(PrefillGpu, SegmentsRepeatsAndGraphReplayAreBitIdentical) {
  KdaOptions o;
  o.seqlens = {700, 33, 2048, 0};
  o.H = 3;
  o.initial_state = StateKind::kF32, o.final_state = StateKind::kBF16;
  KdaInputs in(o);
  DeviceProblem dev(in, segments(8));
  dev.poison();
  dev.run();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  dev.download();
  const auto out0 = in.out.bytes, fin0 = in.final_state.bytes;
  dev.poison();
  dev.run();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  dev.download();
  EXPECT_TRUE(out0 == in.out.bytes) << "out differs on a repeat";
  EXPECT_TRUE(fin0 == in.final_state.bytes) << "final_state differs on a repeat";

  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  dev.poison();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  dev.run(stream);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 2; ++i) CUDA_OK(cudaGraphLaunch(exec, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  dev.download();
  EXPECT_TRUE(out0 == in.out.bytes) << "graph replay differs from the eager run";
  EXPECT_TRUE(fin0 == in.final_state.bytes);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST_F(PrefillGpu, SegmentsInvalidDeviceCuSeqlensPoisonOutputs) {
  expect_bad_cu_seqlens_poison_outputs({400, 300, 200}, segments(2));
}

// internal::segment_transition on the GPU: for random start states X the returned (A, B) give
// X^T A^T + B^T = what the fp64 recurrence gives from X, on random and adversarial inputs.
TEST_F(PrefillGpu, SegmentTransitionMapsAnyStartStateLikeTheRecurrence) {
  struct Case {
    const char* name;
    GateForm gate;
    double g_min, g_max;
    bool repeated_key;
    double tol_precise;  // 5e-4 on random inputs, 2e-3 on the adversarial ones (the prefill contract)
  };
  const Case cases[] = {{"lower_bound", GateForm::kLowerBound, -3, 3, false, 5e-4},
                        {"precomputed_-1000", GateForm::kPrecomputed, -1000, 0, false, 5e-4},
                        {"precomputed_little_decay", GateForm::kPrecomputed, -0.02, 0, false, 2e-3},
                        {"repeated_key", GateForm::kLowerBound, -12, -12, true, 2e-3}};
  for (const Precision precision : kModes)
    for (const Case& c : cases) {
      KdaOptions o;
      o.seqlens = {0, 1, 77, 1500};
      o.H = 2;
      o.precision = precision;
      o.gate = c.gate, o.g_min = c.g_min, o.g_max = c.g_max;
      if (c.gate == GateForm::kPrecomputed) o.with_dt_bias = false, o.g_dtype = DType::kF32;
      if (c.repeated_key) o.beta_min = o.beta_max = 8.0;
      o.initial_state = StateKind::kF32;
      o.initial_state_std = 1.0;
      KdaInputs in(o);
      if (c.repeated_key)
        for (int64_t t = 1; t < o.T; ++t)
          for (int64_t h = 0; h < o.H; ++h)
            for (int64_t ch = 0; ch < o.K; ++ch) in.k.set((t * o.H + h) * o.K + ch, in.k.get(h * o.K + ch));
      const Reference ref = run_reference(in);
      DeviceProblem dev(in);
      PrefillParams p = dev.params();
      p.initial_state = nullptr;
      const int64_t NH = in.N * o.H;
      DeviceBuffer a(size_t(NH) * 128 * 128 * 4), b(size_t(NH) * 128 * 128 * 4);
      DeviceBuffer ws(internal::segment_transition_workspace_size(p));
      internal::segment_transition(p, static_cast<float*>(a.ptr), static_cast<float*>(b.ptr), ws.ptr, ws.bytes);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      std::vector<float> ha(NH * 128 * 128), hb(NH * 128 * 128);
      cudaMemcpy(ha.data(), a.ptr, ha.size() * 4, cudaMemcpyDeviceToHost);
      cudaMemcpy(hb.data(), b.ptr, hb.size() * 4, cudaMemcpyDeviceToHost);
      const double err = rel_rms(apply_transition(ha, hb, in.initial_state.values(), NH, 128, 128), ref.final_state);
      const bool fast = precision == Precision::kFast;
      EXPECT_LE(err, fast ? 2e-2 : c.tol_precise) << c.name << " " << in.describe();
      report(std::string("gpu_transition_") + precision_name(precision) + "_" + c.name + "_state", err);
    }
}

// NaN in is NaN out on the GPU too (as on the CPU, CpuPrefill.NonFiniteGatesPropagate): a NaN raw
// gate, or +inf in a precomputed log-decay, leaves the affected head's final state non-finite,
// with and without segments; the other head stays finite.
TEST_F(PrefillGpu, NonFiniteGatesPropagate) {
  for (const internal::PrefillLaunch launch : {kSerial, segments(1)}) {
    for (const GateForm gate : {GateForm::kLowerBound, GateForm::kSoftplus, GateForm::kPrecomputed}) {
      for (const double bad : {double(NAN), double(INFINITY)}) {
        if (std::isinf(bad) && gate != GateForm::kPrecomputed) continue;
        KdaOptions o;
        o.T = 40, o.H = 2, o.gate = gate, o.g_dtype = DType::kF32;
        if (gate == GateForm::kPrecomputed) o.g_min = -1, o.g_max = 0, o.with_dt_bias = false;
        o.final_state = StateKind::kF32;
        KdaInputs in(o);
        in.g.set((20 * o.H + 1) * o.K + 3, bad);
        DeviceProblem dev(in, launch);
        dev.poison();
        dev.run();
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        dev.download();
        const std::vector<double> fs = in.final_state.values();
        int64_t bad1 = 0, bad0 = 0;
        for (int64_t i = 0; i < o.V * o.K; ++i) {
          bad0 += std::isfinite(fs[i]) ? 0 : 1;
          bad1 += std::isfinite(fs[o.V * o.K + i]) ? 0 : 1;
        }
        EXPECT_GT(bad1, 0) << gate_form_name(gate) << " " << bad << " segments " << launch.segment_chunks;
        EXPECT_EQ(bad0, 0) << gate_form_name(gate) << " " << bad << " segments " << launch.segment_chunks;
      }
    }
  }
}

}  // namespace
}  // namespace flashkda::test
