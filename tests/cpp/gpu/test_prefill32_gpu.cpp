// Prefill v2 end to end (src/cuda/sm90/prefill_v2): the chunk-32 producer's records then the
// recurrence over them (produce.h, consume.h: two kernels), and both in one kernel (fused.h),
// against the fp64 token recurrence (flashkda::reference_forward) on the same bf16 inputs, with
// NaN-poisoned outputs, every fused path with the two kernels' output bits; and their time beside
// today's prefill at the many-head serving shape (a measurement, not a check of speed).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "cuda/sm90/prefill/config.h"
#include "cuda/sm90/prefill_v2/consume.h"
#include "cuda/sm90/prefill_v2/fused.h"
#include "cuda/sm90/prefill_v2/layout.h"
#include "cuda/sm90/prefill_v2/produce.h"
#include "device_problem.h"
#include "kda_test_utils.h"
#include "launch_config.h"

namespace flashkda::cuda::sm90::prefill_v2 {
namespace {

using test::DeviceBuffer;
using test::DeviceProblem;
using test::KdaInputs;
using test::KdaOptions;
using test::StateKind;

bool gpu_available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) return false;
  cudaDeviceProp prop{};
  return cudaGetDeviceProperties(&prop, 0) == cudaSuccess && prop.major == 9;
}

// Producer + recurrence on the device copies of a problem (one sequence, lower-bound or softplus
// gates, bf16 inputs, fp32 or no initial state, fp32 final state).
struct V2Call {
  DeviceProblem& d;
  DeviceBuffer records;
  ProduceArgs pa;
  ConsumeArgs ca;

  explicit V2Call(DeviceProblem& dp)
      : d(dp), records(size_t((dp.in.opt.T + kChunk - 1) / kChunk) * dp.in.opt.H * ChunkOperands::kBytes) {
    const FusedArgs f = fused_args(d.params());
    pa = f.produce, ca = f.consume;
    pa.out = records.ptr, ca.records = records.ptr;
  }
  // mode 0: producer + recurrence kernels; 1: fused, inputs loaded when a chunk starts; 2: fused,
  // inputs staged by TMA; from 3 the candidates (lower-bound bf16 gates only, candidates()).
  struct Mode {
    const char* name;
    bool staged, producer_regs, consumer_inverse;
  };
  static constexpr int kModes = 9;
  static constexpr Mode kModeTable[kModes] = {{"prefill32 ", false, false, false},
                                              {"fused32 ", false, false, false},
                                              {"fused32 staged ", true, false, false},
                                              {"fused32 setmaxnreg ", false, true, false},
                                              {"fused32 inverting consumers ", false, false, true},
                                              {"fused32 inverting consumers, setmaxnreg ", false, true, true},
                                              {"fused32 staged, inverting consumers, setmaxnreg ", true, true, true},
                                              {"fused32 staged, setmaxnreg ", true, true, false},
                                              {"fused32 staged, inverting consumers ", true, false, true}};
  bool candidates() const { return pa.gate == GateForm::kLowerBound && pa.g_type == ElemType::kBF16; }
  void run(int mode, cudaStream_t stream = nullptr) {
    if (mode > 0) {
      const Mode& m = kModeTable[mode];
      FusedArgs f;
      f.produce = pa, f.consume = ca, f.stage_inputs = m.staged;
      f.producer_regs = m.producer_regs;
      f.consumer_inverse = m.consumer_inverse;
      ASSERT_EQ(fused_chunks(f, stream), cudaSuccess);
    } else {
      ASSERT_EQ(produce_chunks(pa, stream), cudaSuccess);
      ASSERT_EQ(consume_chunks(ca, stream), cudaSuccess);
    }
  }
};

// Every path on one problem: each against the reference, each repeated for the same bits, and every
// fused path with the two kernels' output bits (the same arithmetic in all; rows past the end do
// not reach the outputs of the rows before them).
void check(KdaInputs& in, double out_bound, double state_bound, const char* what) {
  SCOPED_TRACE(std::string(what) + ": " + in.describe());
  const test::Reference ref = test::run_reference(in);
  DeviceProblem d(in);
  V2Call v2(d);
  std::vector<unsigned char> bits[V2Call::kModes];
  const int modes = v2.candidates() ? V2Call::kModes : 3;
  int same = 0, compared = 0;
  for (int mode = 0; mode < modes; ++mode) {
    SCOPED_TRACE(V2Call::kModeTable[mode].name);
    const std::string name = std::string(V2Call::kModeTable[mode].name) + what;
    d.poison();
    v2.run(mode);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    d.download();
    const std::vector<double> got = in.out.values(), got_state = in.final_state.values();
    const double e_out = test::rel_rms(got, ref.out);
    const double e_state = test::rel_rms(got_state, ref.final_state);
    if (!std::isfinite(e_out) || !std::isfinite(e_state)) {  // where it went non-finite
      int64_t bad = 0, first = -1;
      for (size_t i = 0; i < got.size(); ++i)
        if (!std::isfinite(got[i])) bad += 1, first = first < 0 ? int64_t(i) : first;
      const int64_t H = in.opt.H, V = in.opt.V;
      std::printf("[ measure  ] %s: %lld non-finite outputs (reference %lld), the first at token %lld head %lld "
                  "column %lld; %lld non-finite state entries\n",
                  name.c_str(), static_cast<long long>(bad), static_cast<long long>(test::count_nonfinite(ref.out)),
                  static_cast<long long>(first < 0 ? -1 : first / (H * V)),
                  static_cast<long long>(first < 0 ? -1 : first / V % H), static_cast<long long>(first < 0 ? -1 : first % V),
                  static_cast<long long>(test::count_nonfinite(got_state)));
    }
    test::report(name + " out", e_out);
    test::report(name + " state", e_state);
    EXPECT_LE(e_out, out_bound);
    EXPECT_LE(e_state, state_bound);
    EXPECT_TRUE(in.out.guard_intact());
    EXPECT_TRUE(in.final_state.guard_intact());
    bits[mode] = in.out.bytes;
    d.poison();  // the same bits again (no atomics, no order-dependent sums)
    v2.run(mode);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    d.download();
    EXPECT_TRUE(bits[mode] == in.out.bytes) << "a repeated call changed the output";
    if (mode > 0) {
      compared += 1;
      same += bits[mode] == bits[0];
      EXPECT_TRUE(bits[mode] == bits[0]) << "the output differs from the two kernels'";
    }
  }
  test::report(std::string("fused32 paths with the two kernels' bits (of ") + std::to_string(compared) + ") " + what,
               same);
}

class Prefill32Gpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!gpu_available()) GTEST_SKIP() << "no Hopper (sm_90) CUDA GPU visible: GPU chunk-32 prefill tests skipped";
  }
};

TEST_F(Prefill32Gpu, RandomInputsOddLengthWithStates) {
  KdaOptions o;
  o.T = 301, o.H = 3, o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
  KdaInputs in(o);
  check(in, 2e-3, 5e-4, "random T=301 H=3 fp32 states");
}

TEST_F(Prefill32Gpu, SoftplusGatesNoInitialState) {
  KdaOptions o;
  o.T = 200, o.H = 2, o.gate = GateForm::kSoftplus, o.g_min = -8.0, o.g_max = 2.0, o.A_log_min = -2.0,
  o.A_log_max = -1.0, o.final_state = StateKind::kF32;  // |Gamma| stays under the factorised limit
  KdaInputs in(o);
  check(in, 2e-3, 5e-4, "softplus T=200 H=2");
}

// Long memory: a quarter of the channels with almost no decay (dt_bias far negative).
TEST_F(Prefill32Gpu, LongMemoryChannels) {
  KdaOptions o;
  o.T = 1000, o.H = 2, o.final_state = StateKind::kF32;
  KdaInputs in(o);
  for (int64_t c = 0; c < o.H * o.K; c += 4) in.dt_bias[c] = -30.f;
  check(in, 2e-3, 5e-4, "long memory T=1000 H=2");
}

// One key for every token, raw gate -12, beta logit 8 (issue 11's adversarial input, shortened).
// (seed 5896445151461294996 went non-finite on every path in run 77; kept as a case.)
TEST_F(Prefill32Gpu, RepeatedKey) {
  for (uint64_t seed : {uint64_t(5896445151461294996ull), uint64_t(0)}) {
    KdaOptions o;
    o.T = 2048, o.H = 2, o.final_state = StateKind::kF32, o.seed = seed;
    KdaInputs in(o);
    const int64_t row = o.H * o.K;
    for (int64_t i = row; i < o.T * row; ++i) in.k.set(i, in.k.get(i % row));
    for (int64_t i = 0; i < o.T * row; ++i) in.g.set(i, -12.0);
    for (int64_t i = 0; i < o.T * o.H; ++i) in.beta.set(i, 8.0);
    check(in, 3e-3, 2e-3, "repeated key T=2048 H=2");
  }
}

// A call's bits as the tests compare them: its outputs, then its final states.
std::vector<unsigned char> out_and_state_bits(const KdaInputs& in) {
  std::vector<unsigned char> bits(in.out.bytes.begin(), in.out.bytes.end());
  bits.insert(bits.end(), in.final_state.bytes.begin(), in.final_state.bytes.end());
  return bits;
}

// internal::PrefillLaunch::fused_v2 = 1 (wherever it serves): the library's prefill runs the fused kernel
// where it serves the call, with the bits of the kernel called directly with its best flags (staged
// inputs, inverting consumers, setmaxnreg) and the reference's accuracy; where it does not (a bf16
// final state, two sequences, the fast mode), today's kernels with the default launch's bits.
std::vector<unsigned char> run_bits(KdaInputs& in, DeviceProblem& d, V2Call* direct = nullptr) {
  d.poison();
  if (direct != nullptr) direct->run(6);
  else d.run();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  d.download();
  return out_and_state_bits(in);
}

// Whether d's last call (with internal fused_pieces) stopped its pieces: the flag that heads the
// pieces' workspace area, right after the kernels' (the size of the workspace without pieces). Bits
// alone cannot tell where the rule's kernel is the fused one: where every warm-up washes the dropped
// state out below the fp32 rounding, the pieces give the unsplit kernel's bits.
// Moderate decay on every channel: raw gates 0, dt_bias -1.86, A_log 0 (lower bound -5), so each
// token decays every channel by ~0.97 in log2 units and a 32-token chunk by ~-31: the gates'
// pre-check of unchained pieces (the consumers' precheck_warmups) finds max_c e^{Gamma_c} below 2^-29.5 and
// lets them run, but a warm-up chunk's bound with its key terms (~32 beta 2^-31) is above 2^-30, so a
// piece stops them (flag 1) and they drain: the path the pre-check otherwise takes off the tests.
void moderate_decay(KdaInputs& in) {
  for (int64_t i = 0; i < in.g.count; ++i) in.g.set(i, 0.0);
  for (auto& x : in.dt_bias) x = -1.86f;
  for (auto& x : in.A_log) x = 0.f;
}

// pieces_flags_at: where the pieces' flag stands in the workspace of p's call with `launch` (after
// the chunk-16 kernels' part, which the pieces do not change).
size_t pieces_flags_at(const PrefillParams& p, internal::PrefillLaunch launch) {
  launch.fused_pieces = -1;
  return internal::workspace_size(p, launch);
}
// pieces_flags: that flag and, for chained pieces, the tickets taken after it (every CTA of the
// pieces' grid takes one as it starts: N pieces H where the pieces' kernel ran).
std::array<int, 2> pieces_flags(DeviceProblem& d) {
  const size_t at = pieces_flags_at(d.params(), d.launch);
  std::array<int, 2> flags{-1, -1};
  EXPECT_EQ(cudaMemcpy(flags.data(), static_cast<const unsigned char*>(d.workspace->ptr) + at,
                       (d.launch.fused_chain > 0 ? 2 : 1) * sizeof(int), cudaMemcpyDeviceToHost),
            cudaSuccess);
  return flags;
}
bool pieces_stopped(DeviceProblem& d) { return pieces_flags(d)[0] != 0; }

// The call captured in a CUDA graph on a stream of its own (the capture fails if the call
// synchronises or allocates); replay() runs it on poisoned outputs and returns its bits.
struct CapturedCall {
  KdaInputs& in;
  DeviceProblem& d;
  cudaStream_t stream{};
  cudaGraph_t graph{};
  cudaGraphExec_t exec{};

  CapturedCall(KdaInputs& in_, DeviceProblem& d_) : in(in_), d(d_) {
    EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    EXPECT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
    d.run(stream);
    EXPECT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    EXPECT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  }
  ~CapturedCall() {
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
  }
  // flush (timing only): a device buffer larger than L2 written before each replay, so that the call
  // finds none of its inputs or code in L2. warm (timing only): another captured call replayed between
  // the flush and this one (on its own inputs: this call's code warm, its data cold).
  std::vector<unsigned char> replay(int times = 1, const DeviceBuffer* flush = nullptr, const CapturedCall* warm = nullptr) {
    d.poison();
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (int i = 0; i < times; ++i) {
      if (flush != nullptr) EXPECT_EQ(cudaMemsetAsync(flush->ptr, i & 0xff, flush->bytes, stream), cudaSuccess);
      if (warm != nullptr) EXPECT_EQ(cudaGraphLaunch(warm->exec, stream), cudaSuccess);
      EXPECT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    }
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    d.download();
    return out_and_state_bits(in);
  }
};

// The call replayed twice from a CUDA graph: its bits.
std::vector<unsigned char> graph_replay_bits(KdaInputs& in, DeviceProblem& d) { return CapturedCall(in, d).replay(2); }

// d's call with its states in a pool of P slots of `dtype` at `pool`, sequence n in slot slots[n]
// (device int32; outside [0, P): padding), and no state tensors.
PrefillParams in_pool(const DeviceProblem& d, void* pool, DType dtype, int64_t P, const void* slots) {
  PrefillParams p = d.params();
  p.initial_state = nullptr, p.final_state = nullptr;
  p.state_pool = pool, p.state_pool_dtype = dtype, p.pool_size = P;
  p.state_indices = static_cast<const int32_t*>(slots);
  return p;
}

// p (d's call with arguments of its own: a pool, checkpoints) through `launch` with a workspace
// sized for it, on d's poisoned outputs (zeros first: on zeros); d's outputs downloaded.
void forward_call(DeviceProblem& d, const PrefillParams& p, const internal::PrefillLaunch& launch,
                  bool zeros_first = false) {
  DeviceBuffer ws(internal::workspace_size(p, launch));
  d.poison();
  if (zeros_first) ASSERT_EQ(cudaMemset(d.out, 0, d.in.out.data_bytes()), cudaSuccess);
  internal::forward(p, launch, ws.ptr, ws.bytes);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  d.download();
}

// d's call with the rule's launch in a workspace of the size `smaller` needs (less than the rule's own,
// which the call then does without): its outputs then final states.
std::vector<unsigned char> bits_in_workspace_of(KdaInputs& in, DeviceProblem& d, const internal::PrefillLaunch& smaller) {
  const PrefillParams p = d.params();
  DeviceBuffer ws(internal::workspace_size(p, smaller));
  EXPECT_LT(ws.bytes, internal::workspace_size(p, internal::PrefillLaunch{})) << "not a smaller workspace";
  d.poison();
  internal::forward(p, internal::PrefillLaunch{}, ws.ptr, ws.bytes);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  d.download();
  return out_and_state_bits(in);
}

// d's call with its final state written over its initial one (one device buffer holding the initial
// state, as a caller that updates a state in place passes it): its outputs then final states.
std::vector<unsigned char> bits_in_place(KdaInputs& in, DeviceProblem& d) {
  DeviceBuffer state(in.initial_state.bytes.size());
  EXPECT_EQ(in.initial_state.bytes.size(), in.final_state.bytes.size());
  EXPECT_EQ(cudaMemcpy(state.ptr, in.initial_state.bytes.data(), state.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  PrefillParams p = d.params();
  p.initial_state = p.final_state = state.ptr;
  forward_call(d, p, d.launch);
  EXPECT_EQ(cudaMemcpy(in.final_state.bytes.data(), state.ptr, state.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  return out_and_state_bits(in);
}

// d's one-sequence call (B = 1, no cu_seqlens) as device cu_seqlens [0, T] name it (what engines pass).
PrefillParams by_device_cu_seqlens(DeviceProblem& d) {
  const int32_t cu[2] = {0, int32_t(d.in.opt.T)};
  PrefillParams p = d.params();
  p.cu_seqlens = d.upload(cu, sizeof(cu)), p.cu_seqlens_dtype = DType::kI32, p.num_seqs = 1;
  return p;
}

// That call with the rule's launch: its outputs then final states.
std::vector<unsigned char> bits_by_cu_seqlens(KdaInputs& in, DeviceProblem& d) {
  forward_call(d, by_device_cu_seqlens(d), internal::PrefillLaunch{});
  return out_and_state_bits(in);
}

// A state pool of P fp32 slots holding a fixed pattern (the pool cases of the rule's tests):
// run() makes d's call with its states in the pool at the device slots, from that pattern, on
// poisoned outputs (zeros first: on zeros), and downloads the outputs; now() is the pool after it.
struct TestPool {
  std::vector<float> init;
  DeviceBuffer buf;
  int64_t P;
  TestPool(int64_t slots, size_t slot_floats) : init(size_t(slots) * slot_floats), buf(init.size() * 4), P(slots) {
    for (size_t i = 0; i < init.size(); ++i) init[i] = 0.01f * float(int64_t(i * 2654435761u % 201) - 100);
  }
  void run(DeviceProblem& d, const void* slots, const internal::PrefillLaunch& launch, bool zeros_first = false) {
    ASSERT_EQ(cudaMemcpy(buf.ptr, init.data(), buf.bytes, cudaMemcpyHostToDevice), cudaSuccess);
    const PrefillParams p = in_pool(d, buf.ptr, DType::kF32, P, slots);
    ASSERT_TRUE(fused_serves(p));
    forward_call(d, p, launch, zeros_first);
  }
  // The outputs' bytes, then the pool's (after run).
  std::vector<unsigned char> bits(const KdaInputs& in) const {
    std::vector<unsigned char> b(in.out.bytes.begin(), in.out.bytes.end());
    const std::vector<float> after = now();
    const auto* raw = reinterpret_cast<const unsigned char*>(after.data());
    b.insert(b.end(), raw, raw + buf.bytes);
    return b;
  }
  std::vector<float> now() const {
    std::vector<float> host(init.size());
    EXPECT_EQ(cudaMemcpy(host.data(), buf.ptr, buf.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }
};

// The fused kernel through the library's call (fused_v2 = 1) on `in` against the fp64 reference: its
// errors reported under `name` and held to the precise mode's bounds; returns the call's bits.
std::vector<unsigned char> fused_call_against_reference(KdaInputs& in, const std::string& name) {
  internal::PrefillLaunch always;
  always.fused_v2 = 1;
  const test::Reference ref = test::run_reference(in);
  DeviceProblem d(in, always);
  EXPECT_TRUE(fused_serves(d.params()));
  const std::vector<unsigned char> bits = run_bits(in, d);
  const double e_out = test::rel_rms(in.out.values(), ref.out);
  const double e_state = test::rel_rms(in.final_state.values(), ref.final_state);
  test::report(name + " out", e_out);
  test::report(name + " state", e_state);
  EXPECT_LE(e_out, 2e-3);
  EXPECT_LE(e_state, 5e-4);
  EXPECT_TRUE(in.out.guard_intact());
  EXPECT_TRUE(in.final_state.guard_intact());
  return bits;
}

TEST_F(Prefill32Gpu, LaunchOptionRunsTheFusedKernelWhereItServes) {
  internal::PrefillLaunch fused;
  fused.fused_v2 = 1;
  {
    KdaOptions o;
    o.T = 301, o.H = 3, o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
    KdaInputs in(o);
    SCOPED_TRACE(in.describe());
    const std::vector<unsigned char> through_launch = fused_call_against_reference(in, "fused32 launch T=301");
    DeviceProblem d(in);
    ASSERT_TRUE(V2Call::kModeTable[6].staged && V2Call::kModeTable[6].producer_regs &&
                V2Call::kModeTable[6].consumer_inverse);
    V2Call direct(d);
    EXPECT_TRUE(through_launch == run_bits(in, d, &direct)) << "the launch option's bits differ from the kernel's";
  }
  for (int variant = 0; variant < 2; ++variant) {
    KdaOptions o;
    o.T = 301, o.H = 3, o.final_state = variant == 0 ? StateKind::kBF16 : StateKind::kF32;
    if (variant == 1) o.precision = Precision::kFast;
    KdaInputs in(o);
    SCOPED_TRACE(in.describe());
    DeviceProblem d_fused(in, fused), d_default(in);
    EXPECT_FALSE(fused_serves(d_fused.params()));
    EXPECT_TRUE(run_bits(in, d_fused) == run_bits(in, d_default)) << "a call the fused kernel does not serve changed";
  }
}

// Invalid device cu_seqlens (`seqlens`' offsets, decreasing at entry 2) through `launch`: every
// output and final state entry NaN. Zeros first (not the NaN poison), so that only the kernels' NaN
// can fill them.
void expect_invalid_cu_seqlens_poison(const std::vector<int64_t>& seqlens, int64_t H, const internal::PrefillLaunch& launch) {
  KdaOptions o;
  o.seqlens = seqlens, o.H = H, o.final_state = StateKind::kF32;
  KdaInputs in(o);
  in.cu_seqlens.set(2, 10.0);
  SCOPED_TRACE(in.describe());
  DeviceProblem d(in, launch);
  ASSERT_EQ(cudaMemset(d.out, 0, in.out.data_bytes()), cudaSuccess);
  ASSERT_EQ(cudaMemset(d.fin, 0, in.final_state.data_bytes()), cudaSuccess);
  d.run();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  d.download();
  EXPECT_EQ(test::count_nonfinite(in.out.values()), in.out.count);
  EXPECT_EQ(test::count_nonfinite(in.final_state.values()), in.final_state.count);
}

// Sequence n of a call as a call of its own: its rows of q, k, v, g, beta and its initial state
// copied byte for byte from `in` (one head layout, the same options otherwise).
KdaInputs one_sequence(const KdaInputs& in, int64_t bos, int64_t len, int64_t n) {
  KdaOptions o = in.opt;
  o.seqlens.clear(), o.B = 1, o.T = len;
  KdaInputs one(o);
  const int64_t H = o.H, row = H * o.K;
  auto copy_rows = [&](test::HostTensor& dst, const test::HostTensor& src, int64_t per_token) {
    const size_t elem = size_t(dtype_size(src.dtype));
    std::memcpy(dst.bytes.data(), src.bytes.data() + size_t(bos * per_token) * elem, size_t(len * per_token) * elem);
  };
  copy_rows(one.q, in.q, row), copy_rows(one.k, in.k, row), copy_rows(one.v, in.v, H * o.V);
  copy_rows(one.g, in.g, row), copy_rows(one.beta, in.beta, H);
  one.A_log = in.A_log, one.dt_bias = in.dt_bias;
  if (o.initial_state != StateKind::kNone) {
    const size_t per_seq = one.initial_state.data_bytes();
    std::memcpy(one.initial_state.bytes.data(), in.initial_state.bytes.data() + size_t(n) * per_seq, per_seq);
  }
  return one;
}

// fused_v2 = 1 on several sequences (FusedArgs::num_seqs, cu_seqlens; grid H x N): device
// cu_seqlens of both widths with an empty sequence and lengths that are no multiple of 32, and a
// batch without them, against the fp64 reference; each sequence's outputs and final state bit for
// bit those of the same sequence called alone; a NaN or inf at the start of a sequence reaches its
// own state but not the sequence before it, whose last chunk's rows cover it; invalid cu_seqlens
// fill out and final_state with NaN.
TEST_F(Prefill32Gpu, FusedServesBatchesAndVarlen) {
  internal::PrefillLaunch always;
  always.fused_v2 = 1;
  for (const DType cu : {DType::kI32, DType::kI64}) {
    KdaOptions o;
    o.seqlens = {100, 0, 301, 33, 64}, o.cu_dtype = cu, o.H = 3;
    o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
    KdaInputs in(o);
    SCOPED_TRACE(in.describe());
    fused_call_against_reference(in, std::string("fused32 varlen cu ") + dtype_name(cu));
    int64_t bos = 0;
    for (int64_t n = 0; n < int64_t(o.seqlens.size()); ++n) {
      const int64_t len = o.seqlens[n];
      KdaInputs one = one_sequence(in, bos, len, n);
      if (len > 0) {
        DeviceProblem d_one(one, always);
        run_bits(one, d_one);
        const size_t out_row = size_t(o.H * o.V) * 2, state = one.final_state.data_bytes();
        EXPECT_EQ(std::memcmp(one.out.bytes.data(), in.out.bytes.data() + size_t(bos) * out_row, size_t(len) * out_row), 0)
            << "sequence " << n << ": its outputs differ from the same sequence called alone";
        EXPECT_EQ(std::memcmp(one.final_state.bytes.data(), in.final_state.bytes.data() + size_t(n) * state, state), 0)
            << "sequence " << n << ": its final state differs from the same sequence called alone";
      }
      bos += len;
    }
  }
  {  // a batch of two sequences without cu_seqlens
    KdaOptions o;
    o.B = 2, o.T = 150, o.H = 3, o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
    KdaInputs in(o);
    SCOPED_TRACE(in.describe());
    fused_call_against_reference(in, "fused32 batch 2 x 150");
  }
  {  // non-finite inputs at the start of sequence 1, inside the TMA box of sequence 0's last chunk
    KdaOptions o;
    o.seqlens = {100, 60}, o.H = 2, o.final_state = StateKind::kF32, o.seed = 7;
    KdaInputs clean(o), dirty(o);
    dirty.k.set((100 * o.H + 1) * o.K + 5, double(NAN));
    dirty.v.set((101 * o.H + 0) * o.V + 7, double(INFINITY));
    dirty.g.set((102 * o.H + 1) * o.K + 9, double(NAN));
    DeviceProblem d_clean(clean, always), d_dirty(dirty, always);
    run_bits(clean, d_clean);
    run_bits(dirty, d_dirty);
    // the clean call wrote every output and state entry (the poison is NaN)
    ASSERT_EQ(test::count_nonfinite(clean.out.values()), 0);
    ASSERT_EQ(test::count_nonfinite(clean.final_state.values()), 0);
    const size_t out0 = size_t(100 * o.H * o.V) * 2, state0 = size_t(o.H * o.V * o.K) * 4;
    EXPECT_EQ(std::memcmp(clean.out.bytes.data(), dirty.out.bytes.data(), out0), 0)
        << "a non-finite input of sequence 1 changed sequence 0's outputs";
    EXPECT_EQ(std::memcmp(clean.final_state.bytes.data(), dirty.final_state.bytes.data(), state0), 0)
        << "a non-finite input of sequence 1 changed sequence 0's final state";
    const std::vector<double> fs = dirty.final_state.values();
    int64_t bad1 = 0;
    for (size_t i = state0 / 4; i < fs.size(); ++i) bad1 += std::isfinite(fs[i]) ? 0 : 1;
    EXPECT_GT(bad1, 0) << "sequence 1's non-finite inputs left its final state finite";
  }
  // invalid device cu_seqlens: every output and final state entry NaN
  expect_invalid_cu_seqlens_poison({40, 30, 20}, 2, always);
}

// The rule (fused_v2 = 0, config.h fused_rule) for calls without cu_seqlens, which the host decides:
// the fused kernel where it serves B sequences of T >= 64 tokens with 3 B H >= 2 SMs, today's
// kernels below either edge; a pool call the same. The two paths give different bits (chunk 32
// against 16), so each side of each edge shows which one ran.
TEST_F(Prefill32Gpu, RuleRunsTheFusedKernelFromTwoThirdsOfTheSms) {
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  const int64_t h_min = (2 * int64_t(sms) + 2) / 3;     // the least H with 3 H >= 2 SMs
  const int64_t h_min2 = (2 * int64_t(sms) + 5) / 6;    // the same for two sequences: 6 H >= 2 SMs
  internal::PrefillLaunch always, never;
  always.fused_v2 = 1, never.fused_v2 = -1;
  struct Case {
    int64_t B, T, H;
    bool fused;
  };
  for (const Case c : {Case{1, 64, h_min, true}, Case{1, 64, h_min - 1, false}, Case{1, 63, h_min, false},
                       Case{2, 512, h_min2, true}, Case{2, 512, h_min2 - 1, false}}) {
    KdaOptions o;
    o.B = c.B, o.T = c.T, o.H = c.H, o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32, o.seed = 5;
    KdaInputs in(o);
    SCOPED_TRACE(in.describe());
    DeviceProblem d_rule(in), d_always(in, always), d_never(in, never);
    ASSERT_TRUE(fused_serves(d_rule.params()));
    const std::vector<unsigned char> rule = run_bits(in, d_rule), fused = run_bits(in, d_always),
                                     today = run_bits(in, d_never);
    EXPECT_FALSE(fused == today) << "the fused kernel and today's kernels gave the same bits";
    EXPECT_TRUE(rule == (c.fused ? fused : today)) << (c.fused ? "the rule did not run the fused kernel"
                                                               : "the rule ran the fused kernel");
  }
  {  // a pool call of a shape the rule gives the fused kernel: the fused kernel's bits
    KdaOptions o;
    o.T = 512, o.H = h_min, o.seed = 5;
    KdaInputs in(o);
    DeviceProblem d(in);
    const size_t slot_bytes = size_t(o.H) * o.V * o.K * 4;
    DeviceBuffer pool(2 * slot_bytes);
    const int32_t slot = 1;
    void* d_slot = d.upload(&slot, 4);
    std::vector<std::vector<unsigned char>> outs;
    for (const internal::PrefillLaunch& launch : {internal::PrefillLaunch{}, never, always}) {
      ASSERT_EQ(cudaMemset(pool.ptr, 0, pool.bytes), cudaSuccess);
      const PrefillParams p = in_pool(d, pool.ptr, DType::kF32, 2, d_slot);
      ASSERT_TRUE(fused_serves(p));
      forward_call(d, p, launch);
      outs.push_back(in.out.bytes);
    }
    EXPECT_TRUE(outs[0] == outs[2]) << "the rule did not run the pool call through the fused kernel";
    EXPECT_FALSE(outs[0] == outs[1]) << "the fused pool call gave the chunk-16 kernels' bits";
    // the pool call is the fused kernel's plain call from a zero state (slot 1 held zeros)
    DeviceProblem d_plain(in, always);
    EXPECT_TRUE(run_bits(in, d_plain) == outs[2]) << "the fused pool call differs from the fused plain call";
    EXPECT_EQ(test::count_nonfinite(in.out.values()), 0);
  }
}

// The rule with device cu_seqlens, which K0 decides (the host cannot read the lengths): the
// chunk-16 kernels, then the fused kernel, each running the call only on K0's verdict. The
// expected side of each case from the rule's formula: 3 H sum ceil(len / 32) >= 2 SMs
// ceil(longest / 32), longest >= kFusedMinTokens. Equal lengths on both sides of the edge
// (int32 and int64 cu_seqlens), mixed lengths, a long sequence among short ones (enough CTAs for
// the host's pre-check, not for the rule, and enough chunks for the strided K1 to walk its grid
// twice), each also with the kernels launched early and replayed from a CUDA graph; a captured
// call replayed after its cu_seqlens changed across the edge (K0 decides again); invalid cu_seqlens
// (all NaN), and a state pool with a padding slot, then with a live slot named twice (all NaN, the
// pool unchanged).
TEST_F(Prefill32Gpu, RuleWithDeviceCuSeqlensIsDecidedByK0) {
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  constexpr int64_t H = 8;
  const int64_t n_min = (2 * int64_t(sms) + 3 * H - 1) / (3 * H);  // equal lengths: 3 N H >= 2 SMs
  auto rule_holds = [&](const std::vector<int64_t>& lens) {
    int64_t total32 = 0, longest = 0;
    for (const int64_t l : lens) total32 += (l + 31) / 32, longest = std::max(longest, l);
    return longest >= prefill::kFusedMinTokens && 3 * H * total32 >= 2 * int64_t(sms) * ((longest + 31) / 32);
  };
  internal::PrefillLaunch always, never, early;
  always.fused_v2 = 1, never.fused_v2 = -1;
  early.early_launch = 15;  // the chunk-16 kernels launched early after their predecessors (a candidate)
  std::vector<int64_t> mixed;
  for (int64_t n = 0; n < n_min + 2; ++n) mixed.push_back(n % 3 == 0 ? 700 : 512 + 37 * (n % 5));
  // 8192 + 20 x 32 tokens: the strided K1 (K0 may choose) walks its grid more than once (573 chunk
  // slots x 8 heads against 24 CTAs an SM)
  std::vector<int64_t> long_among_short = {8192};
  for (int n = 0; n < 20; ++n) long_among_short.push_back(32);
  struct Case {
    std::vector<int64_t> lens;
    DType cu;
    bool fused;
  };
  const std::vector<Case> cases = {{std::vector<int64_t>(n_min, 512), DType::kI32, true},
                                   {std::vector<int64_t>(n_min, 512), DType::kI64, true},
                                   {std::vector<int64_t>(n_min - 1, 512), DType::kI32, false},
                                   {mixed, DType::kI32, true},
                                   {long_among_short, DType::kI64, false}};
  for (const Case& c : cases) {
    ASSERT_EQ(rule_holds(c.lens), c.fused) << "the case's lengths are on the wrong side of the rule on this GPU";
    KdaOptions o;
    o.seqlens = c.lens, o.cu_dtype = c.cu, o.H = H, o.seed = 11;
    o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
    KdaInputs in(o);
    SCOPED_TRACE(in.describe());
    DeviceProblem d_rule(in), d_always(in, always), d_never(in, never), d_early(in, early);
    ASSERT_TRUE(fused_serves(d_rule.params()));
    const std::vector<unsigned char> fused = run_bits(in, d_always), today = run_bits(in, d_never),
                                     rule = run_bits(in, d_rule);
    // the rule's call wrote every entry (the poison is NaN), whichever kernels K0 chose
    EXPECT_EQ(test::count_nonfinite(in.out.values()), 0);
    EXPECT_EQ(test::count_nonfinite(in.final_state.values()), 0);
    EXPECT_FALSE(fused == today) << "the fused kernel and today's kernels gave the same bits";
    EXPECT_TRUE(rule == (c.fused ? fused : today)) << (c.fused ? "K0 did not give the call to the fused kernel"
                                                               : "K0 gave the call to the fused kernel");
    EXPECT_TRUE(rule == run_bits(in, d_early)) << "with the kernels launched early, other bits";
    EXPECT_TRUE(rule == graph_replay_bits(in, d_rule)) << "a graph replay's bits differ from the eager call's";
  }
  {  // a captured call decides again at each replay: the same N and token count, new lengths across the edge
    KdaOptions o;
    o.seqlens = std::vector<int64_t>(n_min, 512), o.H = H, o.seed = 17;
    o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
    KdaInputs in(o);
    std::vector<int64_t> skewed(n_min, 32);  // one long sequence, the rest 32 tokens: the rule fails
    skewed[0] = 512 * n_min - 32 * (n_min - 1);
    ASSERT_TRUE(rule_holds(o.seqlens));
    ASSERT_FALSE(rule_holds(skewed));
    DeviceProblem d(in);
    CapturedCall captured(in, d);
    const std::vector<unsigned char> equal_replayed = captured.replay();
    DeviceProblem d_fused(in, always);
    EXPECT_TRUE(equal_replayed == run_bits(in, d_fused)) << "equal lengths: the replay did not run the fused kernel";
    std::vector<int32_t> cu(n_min + 1, 0);  // the skewed lengths into the captured call's cu_seqlens
    for (int64_t n = 0; n < n_min; ++n) cu[n + 1] = int32_t(cu[n] + skewed[n]);
    ASSERT_EQ(cudaMemcpy(d.cu, cu.data(), cu.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    const std::vector<unsigned char> skewed_replayed = captured.replay();
    for (int64_t n = 0; n <= n_min; ++n) in.cu_seqlens.set(n, double(cu[n]));
    DeviceProblem d_today(in, never);
    EXPECT_TRUE(skewed_replayed == run_bits(in, d_today)) << "skewed lengths: the replay did not run the chunk-16 kernels";
    EXPECT_EQ(test::count_nonfinite(in.out.values()), 0);
  }
  // invalid cu_seqlens of lengths the rule would give the fused kernel
  expect_invalid_cu_seqlens_poison(std::vector<int64_t>(n_min, 512), H, {});
  {  // a state pool (fp32, P = N + 2 slots of random states, sequence 1 padding), then a slot twice
    const int64_t N = n_min + 1, P = N + 2;
    KdaOptions o;
    o.seqlens = std::vector<int64_t>(N, 512), o.H = H, o.seed = 13;
    KdaInputs in(o);
    DeviceProblem d(in);
    const size_t slot_floats = size_t(H) * o.V * o.K;
    TestPool pool(P, slot_floats);
    std::vector<int32_t> slots(N);
    for (int64_t n = 0; n < N; ++n) slots[n] = int32_t((n + 2) % P);  // distinct: N < P
    slots[1] = -1;
    void* d_slots = d.upload(slots.data(), slots.size() * 4);
    std::vector<std::vector<unsigned char>> outs;
    std::vector<std::vector<float>> pools;
    for (const internal::PrefillLaunch& launch : {internal::PrefillLaunch{}, always, never}) {
      pool.run(d, d_slots, launch);
      outs.push_back(in.out.bytes), pools.push_back(pool.now());
      if (outs.size() == 1) {  // the rule's call: every output written, the padding sequence's rows
        EXPECT_EQ(test::count_nonfinite(in.out.values()), 0);  // zero, the slots it names no others
        const size_t row = size_t(H) * o.V * 2;  // bytes of a token's bf16 outputs
        const auto pad = in.out.bytes.begin() + std::ptrdiff_t(512 * row);
        EXPECT_TRUE(std::all_of(pad, pad + std::ptrdiff_t(512 * row), [](unsigned char b) { return b == 0; }))
            << "the padding sequence's output rows are not zero";
        for (int64_t slot = 0; slot < P; ++slot)
          if (std::find(slots.begin(), slots.end(), int32_t(slot)) == slots.end())
            EXPECT_TRUE(std::equal(pools[0].begin() + slot * slot_floats, pools[0].begin() + (slot + 1) * slot_floats,
                                   pool.init.begin() + slot * slot_floats))
                << "slot " << slot << ", named by no sequence, changed";
      }
    }
    EXPECT_TRUE(outs[0] == outs[1] && pools[0] == pools[1]) << "K0 did not give the pool call to the fused kernel";
    EXPECT_FALSE(outs[0] == outs[2]) << "the pool call gave the chunk-16 kernels' bits";
    slots[2] = slots[0];  // a live slot named twice
    ASSERT_EQ(cudaMemcpy(d_slots, slots.data(), slots.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    pool.run(d, d_slots, internal::PrefillLaunch{}, true);
    EXPECT_EQ(test::count_nonfinite(in.out.values()), in.out.count) << "a slot named twice: outputs not all NaN";
    EXPECT_TRUE(pool.now() == pool.init) << "a slot named twice: the pool was written";
  }
}

// internal::PrefillLaunch::fused_pieces (a candidate): each sequence in pieces, a piece after the
// first starting fused_warmup chunks early from zero where the warm-up's chunk bounds put the incoming
// state below 2^-30, else every piece stops and the chunk-16 kernels run the call. Random gates
// (A_log <= 0: every channel decays well within a chunk, so one chunk's warm-up bounds it; with
// A_log up to 1 about one warm-up in twenty does not, in a model of these gates): the pieces run
// (other bits than the chunk-16 kernels', within the reference's bounds and near the unsplit fused
// kernel's), one sequence and two of an odd length, more pieces than chunks, the state none or
// fp32, H = 96, graph replays equal to the eager call. The bits of the kernels the rule picks (the
// chunk-16 kernels, at H = 96 the fused kernel) where the pieces must not run: long-memory channels
// (dt_bias -30: no decay) in every head or in one, which the gates' pre-check catches as the
// pieces start (the consumers' precheck_warmups: the flag 2), and a NaN value in the first piece's chunks (the
// exact recurrence carries it into every later token, a piece from zero would not; a piece sets 1).
// in's call in four forced pieces, which a piece stops while they run (flag 1, `stopper` names what
// should have): the bits of the kernels the rule picks, eagerly and replayed from a graph; in holds
// the pieces' call's outputs after it.
void expect_a_piece_stops(KdaInputs& in, const char* stopper) {
  internal::PrefillLaunch pieces;
  pieces.fused_pieces = 4;
  DeviceProblem d_pieces(in, pieces), d_rule(in);
  const std::vector<unsigned char> rule = run_bits(in, d_rule), got = run_bits(in, d_pieces);
  EXPECT_EQ(pieces_flags(d_pieces)[0], 1) << "not stopped by " << stopper;
  EXPECT_TRUE(got == rule) << "a piece stopped the call: not the bits of the kernels the rule picks";
  EXPECT_TRUE(got == graph_replay_bits(in, d_pieces)) << "a graph replay's bits differ from the eager call's";
}

TEST_F(Prefill32Gpu, FusedPiecesSkipOrFallBack) {
  struct Case {
    int64_t B, T, H, pieces;
    int warmup;
    bool states, long_memory_all, long_memory_one, nan_value;
  };
  const Case cases[] = {{1, 2048, 4, 4, 1, true, false, false, false}, {2, 301, 3, 3, 2, false, false, false, false},
                        {1, 96, 2, 5, 1, true, false, false, false},   {1, 1000, 2, 4, 1, true, true, false, false},
                        {1, 1000, 3, 4, 1, true, false, true, false},  {1, 1000, 2, 4, 1, true, false, false, true},
                        {1, 512, 96, 4, 1, true, false, false, false},  {1, 512, 96, 4, 1, true, true, false, false}};
  for (const Case& c : cases) {
    KdaOptions o;
    o.B = c.B, o.T = c.T, o.H = c.H, o.A_log_max = 0.0;
    if (c.states) o.initial_state = StateKind::kF32;
    o.final_state = StateKind::kF32;
    KdaInputs in(o);
    if (c.long_memory_all || c.long_memory_one)
      for (int64_t ch = 0; ch < (c.long_memory_one ? o.K : o.H * o.K); ch += 4) in.dt_bias[ch] = -30.f;
    if (c.nan_value) in.v.set((100 * o.H + 1) * o.V + 7, std::nan(""));  // token 100, head 1
    const bool falls_back = c.long_memory_all || c.long_memory_one || c.nan_value;
    SCOPED_TRACE(in.describe() + " pieces " + std::to_string(c.pieces) + " warmup " + std::to_string(c.warmup));
    internal::PrefillLaunch pieces, never, always;
    pieces.fused_pieces = c.pieces, pieces.fused_warmup = c.warmup;
    never.fused_v2 = -1, always.fused_v2 = 1;
    DeviceProblem d_pieces(in, pieces), d_never(in, never), d_always(in, always), d_rule(in);
    ASSERT_TRUE(fused_pieces_serve(d_pieces.params()));
    const std::vector<unsigned char> today = run_bits(in, d_never), fused = run_bits(in, d_always),
                                     rule = run_bits(in, d_rule);
    const std::vector<unsigned char> got = run_bits(in, d_pieces);
    EXPECT_EQ(pieces_stopped(d_pieces), falls_back) << "the pieces' flag";
    // long-memory channels: the gates' pre-check stops the pieces as they start (flag 2); a NaN
    // value, which the gates do not show: a piece (flag 1)
    if (falls_back) EXPECT_EQ(pieces_flags(d_pieces)[0], c.nan_value ? 1 : 2) << "who stopped the pieces";
    if (!c.nan_value) {
      EXPECT_EQ(test::count_nonfinite(in.out.values()), 0);
      EXPECT_EQ(test::count_nonfinite(in.final_state.values()), 0);
    }
    EXPECT_TRUE(in.out.guard_intact() && in.final_state.guard_intact());
    if (falls_back) {
      EXPECT_TRUE(got == rule) << "a warm-up that bounds nothing: not the bits of the kernels the rule picks";
    } else {
      EXPECT_FALSE(got == today) << "the pieces did not run (the chunk-16 kernels' bits)";
      if (rule != fused) EXPECT_FALSE(got == rule) << "the pieces did not run (the bits of the kernels the rule picks)";
      const test::Reference ref = test::run_reference(in);
      const double e_out = test::rel_rms(in.out.values(), ref.out), e_state = test::rel_rms(in.final_state.values(), ref.final_state);
      test::report("fused pieces " + std::to_string(c.pieces) + " T=" + std::to_string(c.T) + " out", e_out);
      test::report("fused pieces " + std::to_string(c.pieces) + " T=" + std::to_string(c.T) + " state", e_state);
      EXPECT_LE(e_out, 2e-3);
      EXPECT_LE(e_state, 5e-4);
      // against the unsplit fused kernel: the warm-up's state differs by its rounding and by less
      // than 2^-30 of the dropped state, so the outputs by a few bf16 roundings
      test::HostTensor unsplit = in.out;  // in.out: still the pieces' outputs
      std::copy(fused.begin(), fused.begin() + std::ptrdiff_t(in.out.bytes.size()), unsplit.bytes.begin());
      const double e_fused = test::rel_rms(in.out.values(), unsplit.values());
      test::report("fused pieces against the unsplit fused kernel, out", e_fused);
      EXPECT_LE(e_fused, 1e-3);
    }
    EXPECT_TRUE(got == graph_replay_bits(in, d_pieces)) << "a graph replay's bits differ from the eager call's";
  }
  // Moderate decay (moderate_decay): the pre-check lets the pieces run, a warm-up's bound stops them
  // (flag 1), they drain, and the kernels the rule picks run the call.
  {
    KdaOptions o;
    o.T = 1000, o.H = 2, o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
    KdaInputs in(o);
    moderate_decay(in);
    SCOPED_TRACE(in.describe() + " moderate decay");
    expect_a_piece_stops(in, "a piece's warm-up (2: the pre-check; 0: the pieces ran)");
    EXPECT_EQ(test::count_nonfinite(in.out.values()), 0);
  }
  // A NaN value in the last piece's own tokens (token T - 10 of head 1): that piece's state ends
  // non-finite, it sets the flag (1) and still stores its final state, which goes straight to the
  // call's final state (a buffer of its own: pieces_final_in_place); the kernels after the pieces
  // write it again, so the rule's bits.
  {
    KdaOptions o;
    o.T = 1000, o.H = 2, o.A_log_max = 0.0, o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
    KdaInputs in(o);
    in.v.set(((o.T - 10) * o.H + 1) * o.V + 7, std::nan(""));
    SCOPED_TRACE(in.describe() + " NaN in the last piece");
    ASSERT_TRUE(pieces_final_in_place(DeviceProblem(in).params()));
    expect_a_piece_stops(in, "the last piece's non-finite state");
  }
  // Device cu_seqlens (K0 first), an empty sequence among them (its final state its initial one):
  // random gates, the pieces run; long memory, the chunk-16 kernels' bits (the rule's, K0 deciding).
  for (const bool long_memory : {false, true}) {
    KdaOptions o;
    o.seqlens = {700, 0, 301, 1500}, o.H = 4, o.A_log_max = 0.0;
    o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
    KdaInputs in(o);
    if (long_memory)
      for (int64_t ch = 0; ch < o.H * o.K; ch += 4) in.dt_bias[ch] = -30.f;
    SCOPED_TRACE(in.describe() + (long_memory ? " long memory" : ""));
    internal::PrefillLaunch pieces, never;
    pieces.fused_pieces = 4, never.fused_v2 = -1;
    DeviceProblem d_pieces(in, pieces), d_never(in, never), d_rule(in);
    ASSERT_TRUE(fused_pieces_serve(d_pieces.params()));
    const std::vector<unsigned char> today = run_bits(in, d_never), rule = run_bits(in, d_rule);
    const std::vector<unsigned char> got = run_bits(in, d_pieces);
    EXPECT_EQ(test::count_nonfinite(in.out.values()), 0);
    EXPECT_EQ(test::count_nonfinite(in.final_state.values()), 0);
    const int64_t state = o.H * o.V * o.K;
    for (int64_t i = 0; i < state; ++i)  // the empty sequence's final state: its initial one
      ASSERT_EQ(in.final_state.get(state + i), in.initial_state.get(state + i)) << "the empty sequence's state";
    EXPECT_EQ(pieces_flags(d_pieces)[0], long_memory ? 2 : 0) << "the pieces' flag (2: the gates' pre-check)";
    if (long_memory) {
      EXPECT_TRUE(got == rule) << "a warm-up that bounds nothing: not the rule's bits";
    } else {
      EXPECT_FALSE(got == today) << "the pieces did not run (the chunk-16 kernels' bits)";
      const test::Reference ref = test::run_reference(in);
      EXPECT_LE(test::rel_rms(in.out.values(), ref.out), 2e-3);
      EXPECT_LE(test::rel_rms(in.final_state.values(), ref.final_state), 5e-4);
    }
    EXPECT_TRUE(got == graph_replay_bits(in, d_pieces)) << "a graph replay's bits differ from the eager call's";
  }
}

// The rule at few heads (no internal option): one sequence whose N H CTAs would leave SMs idle runs in
// unchained pieces, config.h fused_few_head_pieces (#SMs / H a sequence): random gates, the pieces run
// (the bits of the same count forced, not the chunk-16 kernels'; within the reference's bounds);
// long-memory channels in one head, the gates' pre-check stops them (flag 2) and the chunk-16 kernels
// run the call (their bits: internal fused_pieces -1); the same by device cu_seqlens [0, T]; graph
// replays equal; a workspace sized for the call without pieces runs it without them; a launch that
// names a chunk-16 variant gets those kernels. Two equal sequences (B = 2) take half the pieces each.
// The last pieces write the final state themselves (pieces_final_in_place) where it is its own
// buffer (a stopped call's kernels write it again: FusedPiecesSkipOrFallBack's NaN in the last
// piece), through the workspace where it is the initial state's (the same bits).
// B sequences of 2048 tokens at H = 4, which the few-head pieces take (A_log 0, fp32 states), with one
// long-memory channel in head 0 (dt_bias -30) where asked: the pieces' pre-check then stops them.
KdaInputs few_head_inputs(bool long_memory, uint64_t seed, int64_t B = 1) {
  KdaOptions o;
  o.B = B, o.T = 2048, o.H = 4, o.A_log_max = 0.0, o.seed = seed;
  o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
  KdaInputs in(o);
  if (long_memory) in.dt_bias[5] = -30.f;
  return in;
}

TEST_F(Prefill32Gpu, RuleRunsFewHeadPieces) {
  if (!prefill::kFewHeadPiecesByRule) GTEST_SKIP() << "the few-head pieces are not the rule (config.h)";
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  for (const int64_t B : {int64_t(1), int64_t(2)})
    for (const bool long_memory : {false, true}) {
      KdaInputs in = few_head_inputs(long_memory, 47, B);
      const int64_t pieces = prefill::fused_few_head_pieces(in.opt.H, B, in.opt.T / 32, sms);
      ASSERT_GT(pieces, 1) << "the rule cuts no pieces at H = 4 on " << sms << " SMs";
      SCOPED_TRACE(in.describe() + (long_memory ? " long memory" : "") + ", " + std::to_string(pieces) + " pieces");
      internal::PrefillLaunch forced, off;
      forced.fused_pieces = pieces, off.fused_pieces = -1;
      DeviceProblem d_rule(in), d_forced(in, forced), d_off(in, off);
      ASSERT_TRUE(fused_pieces_serve(d_rule.params()));
      const std::vector<unsigned char> chunk16 = run_bits(in, d_off);
      const std::vector<unsigned char> rule = run_bits(in, d_rule);
      EXPECT_EQ(test::count_nonfinite(in.out.values()), 0);
      EXPECT_EQ(test::count_nonfinite(in.final_state.values()), 0);
      EXPECT_TRUE(in.out.guard_intact() && in.final_state.guard_intact());
      EXPECT_EQ(pieces_flags(d_rule)[0], long_memory ? 2 : 0) << "the pieces' flag (2: the gates' pre-check)";
      if (long_memory) {
        EXPECT_TRUE(rule == chunk16) << "long memory: not the chunk-16 kernels' bits";
      } else {
        EXPECT_FALSE(rule == chunk16) << "the pieces did not run (the chunk-16 kernels' bits)";
        EXPECT_TRUE(rule == run_bits(in, d_forced)) << "not the bits of " << pieces << " pieces forced";
        internal::PrefillLaunch skipping;  // a chunk-16 variant named (here the rule's own value): no pieces
        skipping.skip_transitions = 1;
        DeviceProblem d_skipping(in, skipping);
        EXPECT_TRUE(run_bits(in, d_skipping) == chunk16) << "a forced chunk-16 variant ran the pieces";
        PrefillParams in_place = d_rule.params();
        in_place.final_state = const_cast<void*>(in_place.initial_state);
        EXPECT_TRUE(pieces_final_in_place(d_rule.params()));
        EXPECT_FALSE(pieces_final_in_place(in_place));
        EXPECT_TRUE(bits_in_place(in, d_rule) == rule) << "the final state over the initial one: other bits";
        const test::Reference ref = test::run_reference(in);
        (void)run_bits(in, d_rule);  // the rule's outputs again (the forced call's are in `in` now)
        const double e_out = test::rel_rms(in.out.values(), ref.out);
        const double e_state = test::rel_rms(in.final_state.values(), ref.final_state);
        test::report("few-head pieces by rule B=" + std::to_string(B) + " out", e_out);
        test::report("few-head pieces by rule B=" + std::to_string(B) + " state", e_state);
        EXPECT_LE(e_out, 2e-3);
        EXPECT_LE(e_state, 5e-4);
      }
      EXPECT_TRUE(rule == graph_replay_bits(in, d_rule)) << "a graph replay's bits differ from the eager call's";
      if (B == 1)  // one sequence by device cu_seqlens [0, T]: the same pieces (K0 ahead), the same bits
        EXPECT_TRUE(bits_by_cu_seqlens(in, d_rule) == rule)
            << "one sequence by cu_seqlens: not the bits of the same call without them";
      // A workspace large enough for the call without pieces only: the call runs without them (the
      // chunk-16 kernels' bits), not refused.
      EXPECT_TRUE(bits_in_workspace_of(in, d_rule, off) == chunk16)
          << "a workspace without room for the pieces: not the chunk-16 kernels' bits";
    }
}

// Low-rank transitions after the pieces (internal lowrank_transitions = 2, a candidate): the pieces'
// rule kept, and where they stop (long memory in one channel of head 0) the chunk-16 kernels after
// them take the low-rank transitions: the bits of the low-rank call without pieces (lowrank 1), not
// the exact transitions', within the reference's bounds; with random gates the pieces' bits.
TEST_F(Prefill32Gpu, LowRankTransitionsAfterThePieces) {
  if (!prefill::kFewHeadPiecesByRule) GTEST_SKIP() << "the few-head pieces are not the rule (config.h)";
  for (const bool long_memory : {false, true}) {
    KdaInputs in = few_head_inputs(long_memory, 53);
    SCOPED_TRACE(in.describe() + (long_memory ? " long memory" : ""));
    internal::PrefillLaunch after, alone;
    after.lowrank_transitions = 2, alone.lowrank_transitions = 1;
    DeviceProblem d_rule(in), d_after(in, after), d_alone(in, alone);
    const std::vector<unsigned char> rule = run_bits(in, d_rule);
    const std::vector<unsigned char> lowrank = run_bits(in, d_after);
    EXPECT_EQ(test::count_nonfinite(in.out.values()), 0);
    EXPECT_EQ(test::count_nonfinite(in.final_state.values()), 0);
    EXPECT_TRUE(in.out.guard_intact() && in.final_state.guard_intact());
    EXPECT_EQ(pieces_flags(d_after)[0], long_memory ? 2 : 0) << "the pieces' flag (2: the gates' pre-check)";
    if (!long_memory) {
      EXPECT_TRUE(lowrank == rule) << "random gates: not the pieces' bits";
      continue;
    }
    EXPECT_FALSE(lowrank == rule) << "long memory: the exact transitions' bits (no low-rank segment)";
    const test::Reference ref = test::run_reference(in);
    (void)run_bits(in, d_after);
    const double e_out = test::rel_rms(in.out.values(), ref.out);
    const double e_state = test::rel_rms(in.final_state.values(), ref.final_state);
    test::report("low-rank transitions after the pieces out", e_out);
    test::report("low-rank transitions after the pieces state", e_state);
    EXPECT_LE(e_out, 2e-3);
    EXPECT_LE(e_state, 5e-4);
    EXPECT_TRUE(run_bits(in, d_alone) == lowrank) << "not the bits of the low-rank call without pieces";
    EXPECT_TRUE(graph_replay_bits(in, d_after) == lowrank) << "a graph replay's bits differ from the eager call's";
  }
}

// A pool call against the plain call from the gathered states (plain: run_bits' outputs then final
// states): each live sequence's output rows bit for bit, and its slot in the pool after the call
// (pool_after) its final state.
void expect_pool_is_plain_call(const KdaInputs& in, const test::HostTensor& out_pool, const std::vector<float>& pool_after,
                               const std::vector<unsigned char>& plain, const std::vector<int32_t>& slots,
                               std::initializer_list<int64_t> live) {
  const int64_t state = in.opt.H * in.opt.V * in.opt.K;
  const size_t seq_bytes = size_t(in.opt.T) * size_t(in.opt.H) * size_t(in.opt.V) * 2;
  const std::vector<double> finals = in.final_state.values();
  for (int64_t n : live) {
    EXPECT_TRUE(std::equal(out_pool.bytes.begin() + std::ptrdiff_t(n * seq_bytes),
                           out_pool.bytes.begin() + std::ptrdiff_t((n + 1) * seq_bytes),
                           plain.begin() + std::ptrdiff_t(n * seq_bytes)))
        << "sequence " << n << "'s outputs differ from the plain call's";
    EXPECT_TRUE(std::equal(pool_after.begin() + slots[size_t(n)] * state, pool_after.begin() + (slots[size_t(n)] + 1) * state,
                           finals.begin() + n * state, [](float a, double b) { return a == float(b); }))
        << "slot " << slots[size_t(n)] << " is not sequence " << n << "'s final state";
  }
}

// The pieces through a state pool (fp32, P = 5 slots of a fixed pattern, sequence 1 padding): the
// live sequences' outputs and final states bit for bit the pieces' plain call from the gathered
// states, the padding rows zero, the slots no sequence names unchanged; with long-memory channels
// the rule's pool call (the pieces stop it); a live slot named twice: K0 refuses, all NaN, the pool
// unchanged.
TEST_F(Prefill32Gpu, FusedPiecesThroughAPool) {
  constexpr int64_t B = 3, T = 640, H = 4, P = 5, kState = H * 128 * 128;
  internal::PrefillLaunch pieces;
  pieces.fused_pieces = 4;
  for (const bool long_memory : {false, true}) {
    KdaOptions o;
    o.B = B, o.T = T, o.H = H, o.A_log_max = 0.0, o.seed = 23;
    o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
    KdaInputs in(o);
    if (long_memory)
      for (int64_t ch = 0; ch < H * o.K; ch += 4) in.dt_bias[ch] = -30.f;
    SCOPED_TRACE(in.describe() + (long_memory ? " long memory" : ""));
    TestPool pool(P, size_t(kState));
    std::vector<int32_t> slots = {3, -1, 0};
    for (int64_t n = 0; n < B; ++n)
      for (int64_t i = 0; i < kState; ++i)
        in.initial_state.set(n * kState + i, slots[n] >= 0 ? double(pool.init[size_t(slots[n] * kState + i)]) : 0.0);
    DeviceProblem d(in, pieces), d_rule(in);
    void* d_slots = d.upload(slots.data(), slots.size() * 4);
    const auto pool_call = [&](DeviceProblem& dp, const internal::PrefillLaunch& launch) {
      EXPECT_TRUE(fused_pieces_serve(in_pool(dp, pool.buf.ptr, DType::kF32, P, d_slots)));
      pool.run(dp, d_slots, launch);
      return std::make_pair(pool.bits(in), pool.now());
    };
    const auto [got, pool_after] = pool_call(d, pieces);
    const test::HostTensor out_pool = in.out;
    for (int64_t slot : {int64_t(1), int64_t(2), int64_t(4)})
      EXPECT_TRUE(std::equal(pool_after.begin() + slot * kState, pool_after.begin() + (slot + 1) * kState,
                             pool.init.begin() + slot * kState))
          << "slot " << slot << ", named by no sequence, changed";
    const size_t row_bytes = size_t(H) * o.V * 2, seq_bytes = size_t(T) * row_bytes;
    EXPECT_TRUE(std::all_of(out_pool.bytes.begin() + std::ptrdiff_t(seq_bytes),
                            out_pool.bytes.begin() + std::ptrdiff_t(2 * seq_bytes), [](unsigned char b) { return b == 0; }))
        << "the padding sequence's output rows are not zero";
    if (long_memory) {
      EXPECT_TRUE(got == pool_call(d_rule, internal::PrefillLaunch{}).first) << "not the rule's pool call";
    } else {
      const std::vector<unsigned char> plain = run_bits(in, d);  // the pieces' plain call
      expect_pool_is_plain_call(in, out_pool, pool_after, plain, slots, {0, 2});
      internal::PrefillLaunch never;
      never.fused_v2 = -1;
      DeviceProblem d_never(in, never);
      EXPECT_FALSE(run_bits(in, d_never) == plain) << "the pieces did not run (the chunk-16 kernels' bits)";
    }
  }
  // H = 96 (the rule's kernel after the pieces is the fused kernel, with K0's verdict): long memory,
  // the rule's pool call; a live slot named twice, refused (the fused kernel's NaN, the pool unchanged).
  // And at H = 4 the same slot twice (the chunk-16 kernels' refusal).
  for (const int64_t heads : {int64_t(96), int64_t(4)}) {
    const int64_t state = heads * 128 * 128;
    for (const bool twice : {false, true}) {
      if (heads == 4 && !twice) continue;
      KdaOptions o;
      o.B = 2, o.T = 256, o.H = heads, o.seed = 29;
      KdaInputs in(o);
      for (int64_t ch = 0; ch < heads * o.K; ch += 4) in.dt_bias[ch] = -30.f;
      SCOPED_TRACE(in.describe() + (twice ? " a slot named twice" : " long memory"));
      DeviceProblem d(in, pieces);
      const std::vector<int32_t> slots = twice ? std::vector<int32_t>{1, 1} : std::vector<int32_t>{1, 3};
      void* d_slots = d.upload(slots.data(), 8);
      TestPool pool(4, size_t(state));
      auto run = [&](const internal::PrefillLaunch& launch) {
        EXPECT_TRUE(fused_pieces_serve(in_pool(d, pool.buf.ptr, DType::kF32, 4, d_slots)));
        pool.run(d, d_slots, launch, /*zeros_first=*/true);  // so that NaN must be written
        return std::make_pair(in.out.bytes, pool.now());
      };
      const auto got = run(pieces);
      if (twice) {
        EXPECT_EQ(test::count_nonfinite(in.out.values()), in.out.count) << "a slot named twice: outputs not all NaN";
        EXPECT_TRUE(got.second == pool.init) << "a slot named twice: the pool was written";
      } else {
        EXPECT_EQ(test::count_nonfinite(in.out.values()), 0);
        EXPECT_TRUE(got == run(internal::PrefillLaunch{})) << "not the rule's pool call";
      }
    }
  }
}

// The pieces through a bf16 pool against an fp32 pool holding the same (bf16) values: the same
// outputs, and each bf16 slot the fp32 slot's final state rounded to bf16 (the pieces run: random
// gates with A_log <= 0).
TEST_F(Prefill32Gpu, FusedPiecesThroughABf16Pool) {
  constexpr int64_t B = 2, T = 320, H = 4, P = 3, kState = H * 128 * 128;
  internal::PrefillLaunch pieces;
  pieces.fused_pieces = 3;
  KdaOptions o;
  o.B = B, o.T = T, o.H = H, o.A_log_max = 0.0, o.seed = 31;
  KdaInputs in(o);
  DeviceProblem d(in, pieces);
  const std::vector<int32_t> slots = {2, 0};
  void* d_slots = d.upload(slots.data(), 8);
  test::HostTensor bf(DType::kBF16, P * kState), f32(DType::kF32, P * kState);
  for (int64_t i = 0; i < P * kState; ++i) bf.set(i, 0.01 * double(int64_t(i * 2654435761u % 201) - 100));
  for (int64_t i = 0; i < P * kState; ++i) f32.set(i, bf.get(i));  // the same values
  std::vector<std::vector<unsigned char>> outs;
  std::vector<test::HostTensor> pools;
  for (test::HostTensor* pool : {&f32, &bf}) {
    DeviceBuffer buf(pool->data_bytes());
    ASSERT_EQ(cudaMemcpy(buf.ptr, pool->bytes.data(), pool->data_bytes(), cudaMemcpyHostToDevice), cudaSuccess);
    const PrefillParams p = in_pool(d, buf.ptr, pool->dtype, P, d_slots);
    ASSERT_TRUE(fused_pieces_serve(p));
    forward_call(d, p, pieces);
    outs.push_back(in.out.bytes);
    test::HostTensor after = *pool;
    ASSERT_EQ(cudaMemcpy(after.bytes.data(), buf.ptr, after.data_bytes(), cudaMemcpyDeviceToHost), cudaSuccess);
    pools.push_back(after);
  }
  EXPECT_EQ(test::count_nonfinite(in.out.values()), 0);
  EXPECT_TRUE(outs[0] == outs[1]) << "the bf16 pool's outputs differ from the fp32 pool's";
  test::HostTensor rounded(DType::kBF16, P * kState);
  for (int64_t i = 0; i < P * kState; ++i) rounded.set(i, pools[0].get(i));
  EXPECT_TRUE(std::equal(rounded.bytes.begin(), rounded.bytes.begin() + std::ptrdiff_t(rounded.data_bytes()),
                         pools[1].bytes.begin()))
      << "the bf16 slots are not the fp32 slots' final states rounded to bf16";
  EXPECT_TRUE(std::equal(pools[1].bytes.begin() + std::ptrdiff_t(kState * 2), pools[1].bytes.begin() + std::ptrdiff_t(2 * kState * 2),
                         bf.bytes.begin() + std::ptrdiff_t(kState * 2)))
      << "slot 1, named by no sequence, changed";
}

// internal::PrefillLaunch::fused_chain (a candidate, with fused_pieces): a piece whose warm-up does
// not bound its transition waits for the piece before it and goes on from its end state instead of
// stopping the call. Random gates (every warm-up bounds): the bits of the pieces without the chain.
// Long-memory channels (dt_bias -30) in every head or in one: the call is not stopped, every chained
// piece is exact (the reference's bounds, and near the unsplit fused kernel's outputs), with device
// cu_seqlens and an empty sequence, through a state pool; a NaN value still stops the call (the
// rule's bits); graph replays equal the eager call. (H = 96 over several waves:
// FusedPiecesChainedOverWaves.)
struct ChainedCase {
  int64_t B, T, H, pieces;
  int warmup;
  bool long_memory_all, long_memory_one, nan_value;
};
void check_chained_pieces(const ChainedCase& c);

TEST_F(Prefill32Gpu, FusedPiecesChained) {
  const ChainedCase cases[] = {{1, 2048, 4, 4, 1, false, false, false}, {1, 1000, 2, 4, 1, true, false, false},
                               {1, 1000, 3, 4, 2, false, true, false},  {2, 301, 3, 3, 1, true, false, false},
                               {1, 1000, 2, 4, 1, false, false, true}};
  for (const ChainedCase& c : cases) check_chained_pieces(c);
  // Device cu_seqlens (K0 first) with an empty sequence, long memory: every piece after a sequence's
  // first chains; the empty sequence's final state is its initial one.
  {
    KdaOptions o;
    o.seqlens = {700, 0, 301, 1500}, o.H = 4, o.A_log_max = 0.0;
    o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
    KdaInputs in(o);
    for (int64_t ch = 0; ch < o.H * o.K; ch += 4) in.dt_bias[ch] = -30.f;
    SCOPED_TRACE(in.describe() + " long memory, chained");
    internal::PrefillLaunch chained;
    chained.fused_pieces = 4, chained.fused_chain = 1;
    DeviceProblem d(in, chained);
    ASSERT_TRUE(fused_pieces_serve(d.params()));
    const std::vector<unsigned char> got = run_bits(in, d);
    EXPECT_FALSE(pieces_stopped(d)) << "the pieces' flag";
    EXPECT_EQ(test::count_nonfinite(in.out.values()), 0);
    EXPECT_EQ(test::count_nonfinite(in.final_state.values()), 0);
    const int64_t state = o.H * o.V * o.K;
    for (int64_t i = 0; i < state; ++i)
      ASSERT_EQ(in.final_state.get(state + i), in.initial_state.get(state + i)) << "the empty sequence's state";
    const test::Reference ref = test::run_reference(in);
    EXPECT_LE(test::rel_rms(in.out.values(), ref.out), 2e-3);
    EXPECT_LE(test::rel_rms(in.final_state.values(), ref.final_state), 5e-4);
    EXPECT_TRUE(got == graph_replay_bits(in, d)) << "a graph replay's bits differ from the eager call's";
  }
  // Through a state pool (fp32, sequence 1 padding), long memory: the live sequences' outputs and
  // slots bit for bit the chained plain call from the gathered states, the padding rows zero, the
  // other slots unchanged.
  {
    constexpr int64_t B = 3, T = 640, H = 4, P = 5, kState = H * 128 * 128;
    internal::PrefillLaunch chained;
    chained.fused_pieces = 4, chained.fused_chain = 1;
    KdaOptions o;
    o.B = B, o.T = T, o.H = H, o.A_log_max = 0.0, o.seed = 37;
    o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
    KdaInputs in(o);
    for (int64_t ch = 0; ch < H * o.K; ch += 4) in.dt_bias[ch] = -30.f;
    SCOPED_TRACE(in.describe() + " long memory, chained, through a pool");
    TestPool pool(P, size_t(kState));
    const std::vector<int32_t> slots = {3, -1, 0};
    for (int64_t n = 0; n < B; ++n)
      for (int64_t i = 0; i < kState; ++i)
        in.initial_state.set(n * kState + i, slots[n] >= 0 ? double(pool.init[size_t(slots[n] * kState + i)]) : 0.0);
    DeviceProblem d(in, chained);
    void* d_slots = d.upload(slots.data(), slots.size() * 4);
    EXPECT_TRUE(fused_pieces_serve(in_pool(d, pool.buf.ptr, DType::kF32, P, d_slots)));
    pool.run(d, d_slots, chained);
    const test::HostTensor out_pool = in.out;
    const std::vector<float> pool_after = pool.now();
    for (int64_t slot : {int64_t(1), int64_t(2), int64_t(4)})
      EXPECT_TRUE(std::equal(pool_after.begin() + slot * kState, pool_after.begin() + (slot + 1) * kState,
                             pool.init.begin() + slot * kState))
          << "slot " << slot << ", named by no sequence, changed";
    const size_t seq_bytes = size_t(T) * H * o.V * 2;
    EXPECT_TRUE(std::all_of(out_pool.bytes.begin() + std::ptrdiff_t(seq_bytes),
                            out_pool.bytes.begin() + std::ptrdiff_t(2 * seq_bytes), [](unsigned char b) { return b == 0; }))
        << "the padding sequence's output rows are not zero";
    const std::vector<unsigned char> plain = run_bits(in, d);  // the chained plain call
    expect_pool_is_plain_call(in, out_pool, pool_after, plain, slots, {0, 2});
  }
}

// One case of FusedPiecesChained (and of the many-wave test below): the chained pieces against the
// unchained ones, the unsplit fused kernel, the rule and the fp64 reference.
void check_chained_pieces(const ChainedCase& c) {
  KdaOptions o;
  o.B = c.B, o.T = c.T, o.H = c.H, o.A_log_max = 0.0;
  o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
  KdaInputs in(o);
  if (c.long_memory_all || c.long_memory_one)
    for (int64_t ch = 0; ch < (c.long_memory_one ? o.K : o.H * o.K); ch += 4) in.dt_bias[ch] = -30.f;
  if (c.nan_value) in.v.set((100 * o.H + 1) * o.V + 7, std::nan(""));  // token 100, head 1
  const bool chains = c.long_memory_all || c.long_memory_one;
  SCOPED_TRACE(in.describe() + " chained pieces " + std::to_string(c.pieces) + " warmup " + std::to_string(c.warmup));
  internal::PrefillLaunch chained, unchained, always;
  chained.fused_pieces = unchained.fused_pieces = c.pieces;
  chained.fused_warmup = unchained.fused_warmup = c.warmup;
  chained.fused_chain = 1, always.fused_v2 = 1;
  DeviceProblem d_chained(in, chained), d_unchained(in, unchained), d_always(in, always), d_rule(in);
  ASSERT_TRUE(fused_pieces_serve(d_chained.params()));
  const std::vector<unsigned char> fused = run_bits(in, d_always), rule = run_bits(in, d_rule),
                                   unchained_bits = run_bits(in, d_unchained);
  const std::vector<unsigned char> got = run_bits(in, d_chained);
  EXPECT_EQ(pieces_stopped(d_chained), c.nan_value) << "the pieces' flag";
  EXPECT_TRUE(in.out.guard_intact() && in.final_state.guard_intact());
  if (c.nan_value) {
    EXPECT_TRUE(got == rule) << "a NaN before a warm-up: not the bits of the kernels the rule picks";
  } else {
    EXPECT_EQ(test::count_nonfinite(in.out.values()), 0);
    EXPECT_EQ(test::count_nonfinite(in.final_state.values()), 0);
    if (!chains) EXPECT_TRUE(got == unchained_bits) << "no piece chains: not the unchained pieces' bits";
    // (where the rule's kernel is the fused one, H = 96, a chained call may give the unsplit kernel's
    // bits: the chained state differs from the serial one by power-of-two row scales only)
    if (chains && rule != fused) EXPECT_FALSE(got == unchained_bits) << "the chained pieces gave the stopped call's bits";
    const test::Reference ref = test::run_reference(in);
    const double e_out = test::rel_rms(in.out.values(), ref.out), e_state = test::rel_rms(in.final_state.values(), ref.final_state);
    const std::string name = "chained pieces " + std::to_string(c.pieces) + " T=" + std::to_string(c.T) + " H=" + std::to_string(c.H);
    test::report(name + " out", e_out);
    test::report(name + " state", e_state);
    EXPECT_LE(e_out, 2e-3);
    EXPECT_LE(e_state, 5e-4);
    test::HostTensor unsplit = in.out;  // in.out: still the chained pieces' outputs
    std::copy(fused.begin(), fused.begin() + std::ptrdiff_t(in.out.bytes.size()), unsplit.bytes.begin());
    const double e_fused = test::rel_rms(in.out.values(), unsplit.values());
    test::report(name + " against the unsplit fused kernel, out", e_fused);
    EXPECT_LE(e_fused, 1e-3);
  }
  EXPECT_TRUE(got == graph_replay_bits(in, d_chained)) << "a graph replay's bits differ from the eager call's";
}

// The same at H = 96, 384 pieces over three waves of the GPU: the tickets (no piece waits forever).
// Apart from FusedPiecesChained so that the pending sanitizers can leave it out (their time).
TEST_F(Prefill32Gpu, FusedPiecesChainedOverWaves) {
  for (const ChainedCase& c : {ChainedCase{1, 1024, 96, 4, 1, true, false, false}, ChainedCase{1, 1024, 96, 4, 1, false, false, false}})
    check_chained_pieces(c);
}

// Checkpoints in pieces (dense, fp32, poisoned first): a piece writes those after its warm-up,
// numbered from the sequence's start, so the chained pieces (the call's flag block says they ran:
// not stopped, every ticket taken) give the unsplit fused kernel's checkpoints to within its rounding
// (random gates: pieces from their warm-ups; long memory: chained), checkpoints at piece boundaries
// and right after a warm-up of two chunks included, the last partial piece without one. Run 114 (an
// H100): equal bit for bit in all four cases. And through a pool with checkpoint slots (not yet run).
TEST_F(Prefill32Gpu, FusedPiecesCheckpoints) {
  constexpr int64_t T = 2000, H = 4, kState = H * 128 * 128;
  for (const bool long_memory : {false, true})
    for (const int64_t every : {int64_t(256), int64_t(64)}) {
      KdaOptions o;
      o.T = T, o.H = H, o.A_log_max = 0.0, o.seed = 41;
      o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
      KdaInputs in(o);
      if (long_memory)
        for (int64_t ch = 0; ch < H * o.K; ch += 4) in.dt_bias[ch] = -30.f;
      SCOPED_TRACE(in.describe() + (long_memory ? " long memory" : " random") + " every " + std::to_string(every));
      internal::PrefillLaunch chained, fused;
      chained.fused_pieces = 4, chained.fused_chain = 1, chained.fused_warmup = every == 64 ? 2 : 1;
      fused.fused_v2 = 1;
      const int64_t count = T / every;
      std::vector<std::vector<double>> ckpts;
      std::vector<std::vector<unsigned char>> bits;
      for (const internal::PrefillLaunch& launch : {chained, fused}) {
        DeviceProblem d(in, launch);
        test::HostTensor dense(DType::kF32, count * kState);
        void* d_dense = d.upload(dense.bytes.data(), dense.bytes.size());  // poisoned with its guard bytes
        PrefillParams p = d.params();
        p.checkpoint_every = every, p.checkpoints = d_dense, p.checkpoint_dtype = DType::kF32, p.num_checkpoints = count;
        ASSERT_TRUE(fused_pieces_serve(p));
        DeviceBuffer ws(internal::workspace_size(p, launch));
        d.poison();
        internal::forward(p, launch, ws.ptr, ws.bytes);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        d.download();
        if (launch.fused_pieces > 0) {  // the pieces ran: their flag zero, the counter at 4 H tickets taken
          internal::PrefillLaunch plain = launch;
          plain.fused_pieces = -1;
          int flags[2] = {-1, -1};
          ASSERT_EQ(cudaMemcpy(flags, static_cast<const unsigned char*>(ws.ptr) + internal::workspace_size(p, plain),
                               sizeof(flags), cudaMemcpyDeviceToHost),
                    cudaSuccess);
          EXPECT_EQ(flags[0], 0) << "the pieces stopped";
          EXPECT_EQ(flags[1], 4 * H) << "not every piece took its ticket: the call did not run in chained pieces";
        }
        ASSERT_EQ(cudaMemcpy(dense.bytes.data(), d_dense, dense.bytes.size(), cudaMemcpyDeviceToHost), cudaSuccess);
        EXPECT_TRUE(dense.guard_intact());
        EXPECT_EQ(test::count_nonfinite(dense.values()), 0);
        ckpts.push_back(dense.values());
        bits.push_back(out_and_state_bits(in));
      }
      const std::vector<double>& unsplit = ckpts[1];
      const double e = test::rel_rms(ckpts[0], unsplit);
      test::report(std::string("chained pieces' checkpoints against the unsplit fused kernel's, ") +
                       (long_memory ? "long memory" : "random") + " every " + std::to_string(every),
                   e);
      EXPECT_LE(e, 1e-4);
      for (int64_t c = 0; c < count; ++c) {  // each one near the unsplit kernel's
        std::vector<double> a(ckpts[0].begin() + c * kState, ckpts[0].begin() + (c + 1) * kState);
        std::vector<double> b(unsplit.begin() + c * kState, unsplit.begin() + (c + 1) * kState);
        EXPECT_LE(test::rel_rms(a, b), 1e-4) << "checkpoint " << c;
      }
      // (the outputs may equal the unsplit kernel's bit for bit: run 113 measured that where one chunk's
      // warm-up erases the incoming state, A_log <= 0, and where the pieces chain)
    }
  // Through a pool with checkpoint slots (fp32; two sequences in slots 1 and 0, long memory, so the
  // pieces chain; every checkpoint the last chunk of a piece, one slot -1): the pool after the
  // chained pieces near the unsplit call's, the skipped checkpoint's slot untouched.
  {
    constexpr int64_t P = 8;
    KdaOptions o;
    o.B = 2, o.T = 1000, o.H = H, o.A_log_max = 0.0, o.seed = 47;
    KdaInputs in(o);
    for (int64_t ch = 0; ch < H * o.K; ch += 4) in.dt_bias[ch] = -30.f;
    SCOPED_TRACE(in.describe() + " long memory, a pool with checkpoint slots");
    const std::vector<int32_t> seq_slots = {1, 0}, ck_slots = {2, 3, -1, 5, 6, 7};
    internal::PrefillLaunch chained, fused;
    chained.fused_pieces = 4, chained.fused_chain = 1, fused.fused_v2 = 1;
    std::vector<std::vector<double>> pools;
    for (const internal::PrefillLaunch& launch : {chained, fused}) {
      TestPool pool(P, size_t(kState));
      DeviceProblem d(in, launch);
      void* d_slots = d.upload(seq_slots.data(), seq_slots.size() * 4);
      void* d_ck = d.upload(ck_slots.data(), ck_slots.size() * 4);
      PrefillParams p = in_pool(d, pool.buf.ptr, DType::kF32, P, d_slots);
      p.checkpoint_every = 256, p.checkpoint_slots = static_cast<const int32_t*>(d_ck), p.num_checkpoints = 6;
      ASSERT_TRUE(fused_pieces_serve(p));
      ASSERT_EQ(cudaMemcpy(pool.buf.ptr, pool.init.data(), pool.buf.bytes, cudaMemcpyHostToDevice), cudaSuccess);
      forward_call(d, p, launch);
      const std::vector<float> after = pool.now();
      EXPECT_TRUE(std::equal(after.begin() + 4 * kState, after.begin() + 5 * kState, pool.init.begin() + 4 * kState))
          << "slot 4, named by no sequence and no checkpoint, changed";
      pools.emplace_back(after.begin(), after.end());
    }
    for (int64_t slot : {0, 1, 2, 3, 5, 6, 7}) {
      const std::vector<double> a(pools[0].begin() + slot * kState, pools[0].begin() + (slot + 1) * kState),
          b(pools[1].begin() + slot * kState, pools[1].begin() + (slot + 1) * kState);
      EXPECT_LE(test::rel_rms(a, b), 1e-4) << "slot " << slot;
    }
  }
}

// The rule (no internal option): one sequence the fused kernel takes with SMs left idle runs in
// chained pieces, config.h fused_chain_pieces (four at T = 8192, H = 96 on 132 SMs): the bits of the
// same count forced, not those of the unsplit fused kernel (random gates: the pieces run).
TEST_F(Prefill32Gpu, RuleRunsChainedPieces) {
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  constexpr int64_t T = 8192, H = 96;
  const int64_t pieces = prefill::fused_chain_pieces(H, 1, T / 32, sms);
  if (pieces <= 1) GTEST_SKIP() << "the rule cuts no pieces at H = 96 on " << sms << " SMs";
  KdaOptions o;
  o.T = T, o.H = H, o.A_log_max = 0.0, o.seed = 43, o.final_state = StateKind::kF32;
  KdaInputs in(o);
  internal::PrefillLaunch forced, unsplit, off;
  forced.fused_pieces = pieces, forced.fused_chain = 1;
  unsplit.fused_v2 = 1, off.fused_chain = -1;
  DeviceProblem d_rule(in), d_forced(in, forced), d_unsplit(in, unsplit), d_off(in, off);
  const std::vector<unsigned char> rule = run_bits(in, d_rule);
  EXPECT_EQ(test::count_nonfinite(in.out.values()), 0);
  EXPECT_FALSE(pieces_stopped(d_rule)) << "the pieces' flag";
  EXPECT_TRUE(rule == run_bits(in, d_forced)) << "not the bits of " << pieces << " chained pieces";
  const std::vector<unsigned char> whole = run_bits(in, d_unsplit);
  EXPECT_FALSE(rule == whole) << "the unsplit fused kernel's bits: the rule cut no pieces";
  EXPECT_TRUE(run_bits(in, d_off) == whole) << "fused_chain -1: not the unsplit fused kernel";
  EXPECT_TRUE(rule == graph_replay_bits(in, d_rule)) << "a graph replay's bits differ from the eager call's";
  // One sequence by device cu_seqlens [0, T] (what engines pass): the rule cuts the same pieces (K0
  // ahead of them checks the cu_seqlens), so the same bits.
  EXPECT_TRUE(bits_by_cu_seqlens(in, d_rule) == rule) << "one sequence by cu_seqlens: not the bits of the same call without them";
  // A workspace large enough for the call without pieces only: the call runs unsplit, not refused.
  EXPECT_TRUE(bits_in_workspace_of(in, d_rule, off) == whole)
      << "a workspace without room for the pieces: not the unsplit call's bits";
}

// A final state written over the initial one (one buffer, as a caller that updates a state in place
// passes it) gives the bits of two buffers on every path the rule takes for one sequence: the
// few-head pieces (random gates; long memory in one channel, which the chunk-16 kernels then run),
// the chunk-16 kernels alone (fused_pieces -1; and with bf16 states, which the pieces do not serve), the
// chained pieces at many heads and the unsplit fused kernel. Where pieces cut a sequence the first ones
// read the initial state while the last ones write the final state, so there the final states go
// through the workspace (pieces_final_in_place).
TEST_F(Prefill32Gpu, StateInPlaceGivesTheSameBits) {
  if (!prefill::kFewHeadPiecesByRule) GTEST_SKIP() << "the few-head pieces are not the rule (config.h)";
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  struct Case {
    int64_t T, H;
    bool long_memory;
    int fused_pieces, fused_v2;
    int flag;  // the pieces' flag after the call (-1: no pieces)
    const char* name;
    StateKind states = StateKind::kF32;
  };
  const Case cases[] = {{2048, 4, false, 0, 0, 0, "the few-head pieces"},
                        {2048, 4, true, 0, 0, 2, "the few-head pieces stopped by long memory"},
                        {2048, 4, false, -1, 0, -1, "the chunk-16 kernels"},
                        {2048, 4, false, 0, 0, -1, "bf16 states (the chunk-16 kernels)", StateKind::kBF16},
                        {8192, 96, false, 0, 0, 0, "the rule at H = 96 (chained pieces)"},
                        {1024, 96, false, 0, 1, -1, "the unsplit fused kernel"}};
  for (const Case& c : cases) {
    if (c.H == 96 && c.fused_v2 == 0 && prefill::fused_chain_pieces(c.H, 1, c.T / 32, sms) <= 1) {
      ADD_FAILURE() << "the rule cuts no chained pieces at T = " << c.T << " H = 96 on " << sms << " SMs";
      continue;
    }
    KdaOptions o;
    o.T = c.T, o.H = c.H, o.A_log_max = 0.0, o.seed = 53;
    o.initial_state = c.states, o.final_state = c.states;
    KdaInputs in(o);
    if (c.long_memory) in.dt_bias[5] = -30.f;  // one channel of head 0
    SCOPED_TRACE(in.describe() + ", " + c.name);
    internal::PrefillLaunch launch;
    launch.fused_pieces = c.fused_pieces, launch.fused_v2 = c.fused_v2;
    DeviceProblem d(in, launch);
    const std::vector<unsigned char> two = run_bits(in, d);
    if (c.flag >= 0) EXPECT_EQ(pieces_flags(d)[0], c.flag) << "the pieces' flag (2: the gates' pre-check)";
    EXPECT_EQ(test::count_nonfinite(in.out.values()), 0);
    EXPECT_EQ(test::count_nonfinite(in.final_state.values()), 0);
    EXPECT_TRUE(bits_in_place(in, d) == two) << "one state buffer: other bits than two";
  }
}

// internal::forward_allocating (the Python extension's call: one validation): the allocator asked once,
// for workspace_size's bytes (the pieces' area included), and the bits of the call in a workspace of that
// size, through the few-head pieces, the pieces stopped by long memory, and device cu_seqlens (K0 ahead
// of the pieces).
TEST_F(Prefill32Gpu, WorkspaceFromAnAllocatorGivesTheSameBits) {
  struct Case {
    bool long_memory, by_cu_seqlens;
    const char* name;
  };
  for (const Case& c : {Case{false, false, "the few-head pieces"}, Case{true, false, "pieces stopped by long memory"},
                        Case{false, true, "device cu_seqlens"}}) {
    KdaOptions o;
    o.T = 2048, o.H = 4, o.A_log_max = 0.0, o.seed = 59;
    o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
    KdaInputs in(o);
    if (c.long_memory) in.dt_bias[5] = -30.f;
    SCOPED_TRACE(in.describe() + ", " + c.name);
    DeviceProblem d(in);
    const PrefillParams p = c.by_cu_seqlens ? by_device_cu_seqlens(d) : d.params();
    forward_call(d, p, internal::PrefillLaunch{});
    const std::vector<unsigned char> plain = out_and_state_bits(in);
    const size_t needed = internal::workspace_size(p, internal::PrefillLaunch{});
    std::vector<size_t> asked;
    std::unique_ptr<DeviceBuffer> ws;
    d.poison();
    internal::forward_allocating(p, internal::PrefillLaunch{}, [&](size_t bytes) -> void* {
      asked.push_back(bytes);
      ws = std::make_unique<DeviceBuffer>(bytes);
      return ws->ptr;
    });
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    d.download();
    ASSERT_EQ(asked.size(), 1u);
    EXPECT_EQ(asked[0], needed);
    EXPECT_TRUE(out_and_state_bits(in) == plain) << "other bits than the call in a workspace of its size";
  }
}

// A call with few-head pieces captured in a CUDA graph with the kernels after the pieces in a
// conditional node that the pieces' flag opens (PrefillLaunch::pieces_graph_if 1, a candidate): the
// graph holds one conditional node with a body (none without the option), and one graph replayed on
// random gates (the pieces run the call, the node stays shut), then with long-memory channels
// written into its dt_bias in place (the pre-check stops the pieces, the node runs the chunk-16
// kernels), then on random gates again gives the eager call's bits on the same inputs each time, as
// the same call captured without the node does.
TEST_F(Prefill32Gpu, PiecesGraphRunsTheKernelsAfterThemWhereAPieceStops) {
  if (!prefill::kFewHeadPiecesByRule) GTEST_SKIP() << "the few-head pieces are not the rule (config.h)";
  KdaOptions o;
  o.T = 2048, o.H = 4, o.A_log_max = 0.0, o.seed = 59;
  o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
  KdaInputs in(o);
  const std::vector<float> random_bias = in.dt_bias;
  std::vector<float> long_bias = random_bias;
  for (size_t ch = 0; ch < long_bias.size(); ch += 4) long_bias[ch] = -30.f;  // no decay: every head
  internal::PrefillLaunch with_node;
  with_node.pieces_graph_if = 1;
  DeviceProblem d(in, with_node), d_plain(in);
  ASSERT_TRUE(fused_pieces_serve(d.params()));
  const auto set_bias = [&](const std::vector<float>& bias) {
    in.dt_bias = bias;
    for (DeviceProblem* x : {&d, &d_plain})
      ASSERT_EQ(cudaMemcpy(x->dt_bias, bias.data(), bias.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  };
  set_bias(long_bias);  // the eager calls first (they also make the thread's stream for the node's body)
  const std::vector<unsigned char> long_bits = run_bits(in, d);
  EXPECT_EQ(pieces_flags(d)[0], 2) << "long memory: the pre-check's flag";
  set_bias(random_bias);
  const std::vector<unsigned char> random_bits = run_bits(in, d);
  EXPECT_EQ(pieces_flags(d)[0], 0) << "random gates: the pieces ran the call";
  EXPECT_FALSE(random_bits == long_bits);
  CapturedCall node(in, d), plain(in, d_plain);
  // The graphs' top-level nodes by type: with the option one conditional node, which holds the
  // kernels after the pieces (fewer kernel nodes beside it than without, one of them the kernel that
  // sets its condition); without, none. (An empty body would leave the long-memory replay's stopped
  // rows poisoned: the bits below.)
  const auto count = [](cudaGraph_t graph, cudaGraphNodeType want) {
    size_t n = 0, found = 0;
    EXPECT_EQ(cudaGraphGetNodes(graph, nullptr, &n), cudaSuccess);
    std::vector<cudaGraphNode_t> nodes(n);
    EXPECT_EQ(cudaGraphGetNodes(graph, nodes.data(), &n), cudaSuccess);
    for (cudaGraphNode_t x : nodes) {
      cudaGraphNodeType type{};
      EXPECT_EQ(cudaGraphNodeGetType(x, &type), cudaSuccess);
      found += type == want;
    }
    return found;
  };
  EXPECT_EQ(count(node.graph, cudaGraphNodeTypeConditional), 1u) << "the graph with the option: its conditional nodes";
  EXPECT_EQ(count(plain.graph, cudaGraphNodeTypeConditional), 0u) << "the graph without the option: a conditional node";
  EXPECT_LT(count(node.graph, cudaGraphNodeTypeKernel), count(plain.graph, cudaGraphNodeTypeKernel))
      << "the kernels after the pieces are not inside the conditional node";
  for (const bool long_memory : {false, true, false}) {
    SCOPED_TRACE(long_memory ? "long memory" : "random gates");
    set_bias(long_memory ? long_bias : random_bias);
    const std::vector<unsigned char>& want = long_memory ? long_bits : random_bits;
    EXPECT_TRUE(node.replay() == want) << "the graph with the node: not the eager call's bits";
    EXPECT_EQ(pieces_flags(d)[0], long_memory ? 2 : 0);
    EXPECT_TRUE(plain.replay() == want) << "the graph without the node: not the eager call's bits";
  }
}

// The pieces' flags start at zero whatever the workspace held: filled with 0xff bytes before each call,
// the few-head pieces still run (their flag 0 after the call) and give the bits of the call in a zeroed
// workspace, where a memset zeroes the flags (no cu_seqlens) and where K0 does (device cu_seqlens:
// Params::pieces_zero, in place of the memset).
TEST_F(Prefill32Gpu, PiecesFlagsStartAtZeroInAnyWorkspace) {
  if (!prefill::kFewHeadPiecesByRule) GTEST_SKIP() << "the few-head pieces are not the rule (config.h)";
  for (const bool by_cu_seqlens : {false, true}) {
    KdaOptions o;
    o.T = 2048, o.H = 4, o.A_log_max = 0.0, o.seed = 61;
    o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
    KdaInputs in(o);
    SCOPED_TRACE(in.describe() + (by_cu_seqlens ? ", device cu_seqlens (K0 zeroes the flags)" : ", the memset"));
    DeviceProblem d(in);
    const PrefillParams p = by_cu_seqlens ? by_device_cu_seqlens(d) : d.params();
    internal::PrefillLaunch plain;
    plain.fused_pieces = -1;
    const size_t at = internal::workspace_size(p, plain);  // the pieces' area: their flag first
    DeviceBuffer ws(internal::workspace_size(p, internal::PrefillLaunch{}));
    ASSERT_GT(ws.bytes, at) << "no pieces' area: the rule runs no pieces here";
    std::vector<unsigned char> bits[2];
    for (const int fill : {0x00, 0xff}) {
      ASSERT_EQ(cudaMemset(ws.ptr, fill, ws.bytes), cudaSuccess);
      d.poison();
      internal::forward(p, internal::PrefillLaunch{}, ws.ptr, ws.bytes);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      d.download();
      bits[fill != 0] = out_and_state_bits(in);
      int flag = -1;
      ASSERT_EQ(cudaMemcpy(&flag, static_cast<const unsigned char*>(ws.ptr) + at, sizeof(int), cudaMemcpyDeviceToHost),
                cudaSuccess);
      EXPECT_EQ(flag, 0) << "the pieces did not run the call (workspace filled with " << fill << ")";
    }
    EXPECT_TRUE(bits[0] == bits[1]) << "other bits from a workspace filled with 0xff";
  }
}

// Longest first (internal fused_order): K0's order of the sequences in the workspace header (ints
// 3 N + 4 on, after chunk_start, the verdict, seg_start and ckpt_start) is a permutation with the
// length classes (ceil(len / 32)) non-increasing, through the
// forced fused kernel and the rule's path (K0 choosing); the calls' bits equal those in the batch's
// order (fused_order = -1), which has no order written.
TEST_F(Prefill32Gpu, LongestFirstOrder) {
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  std::vector<int64_t> lens = {100, 0, 301, 33, 64, 700, 64, 1};
  while (int64_t(lens.size()) * 16 < 2 * sms) lens.push_back(37 * int64_t(lens.size()) % 500 + 64);  // the rule holds at H = 16
  const int64_t N = int64_t(lens.size());
  KdaOptions o;
  o.seqlens = lens, o.H = 16, o.seed = 37;
  o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
  KdaInputs in(o);
  SCOPED_TRACE(in.describe());
  internal::PrefillLaunch forced, rule, forced_batch, rule_batch;
  forced.fused_v2 = forced_batch.fused_v2 = 1;
  forced_batch.fused_order = rule_batch.fused_order = -1;
  for (const auto& [first, batch] : {std::make_pair(forced, forced_batch), std::make_pair(rule, rule_batch)}) {
    DeviceProblem d(in, first), d_batch(in, batch);
    const std::vector<unsigned char> bits = run_bits(in, d);
    EXPECT_EQ(test::count_nonfinite(in.out.values()), 0);
    std::vector<int32_t> order(size_t(N), -1);
    ASSERT_EQ(cudaMemcpy(order.data(), static_cast<int32_t*>(d.workspace->ptr) + 3 * N + 4, size_t(N) * 4,
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    std::vector<int32_t> sorted = order;
    std::sort(sorted.begin(), sorted.end());
    for (int64_t n = 0; n < N; ++n) ASSERT_EQ(sorted[size_t(n)], n) << "K0's order is not a permutation";
    for (int64_t i = 1; i < N; ++i)
      EXPECT_GE((lens[size_t(order[size_t(i - 1)])] + 31) / 32, (lens[size_t(order[size_t(i)])] + 31) / 32)
          << "K0's order is not longest first at place " << i;
    EXPECT_TRUE(bits == run_bits(in, d_batch)) << "longest first changed the bits";
  }
}

// Checkpoints with device cu_seqlens where K0 chooses: K0 numbers each sequence's first
// checkpoint whichever kernels it picks (the fused kernel reads those numbers too). Equal lengths on
// each side of the rule's edge, dense fp32 checkpoints every 64 tokens, through the rule: every
// output, final state and checkpoint written (the poison is NaN), and the bits of the kernels the rule
// names (fused_v2 = 1 or -1).
TEST_F(Prefill32Gpu, RuleWithDeviceCuSeqlensNumbersCheckpoints) {
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  constexpr int64_t H = 8, kLen = 512, kEvery = 64;
  const int64_t n_min = (2 * int64_t(sms) + 3 * H - 1) / (3 * H);  // equal lengths: 3 N H >= 2 SMs
  internal::PrefillLaunch always, never;
  always.fused_v2 = 1, never.fused_v2 = -1;
  for (const int64_t N : {n_min, n_min - 1}) {
    const bool fused = N >= n_min;
    KdaOptions o;
    o.seqlens = std::vector<int64_t>(size_t(N), kLen), o.H = H, o.seed = 19;
    o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
    KdaInputs in(o);
    SCOPED_TRACE(in.describe());
    const int64_t count = N * (kLen / kEvery), state = H * o.V * o.K;
    auto bits = [&](internal::PrefillLaunch launch) {
      DeviceProblem d(in, launch);
      test::HostTensor cks(DType::kF32, count * state);  // NaN-poisoned
      void* d_cks = d.upload(cks.bytes.data(), cks.bytes.size());
      PrefillParams p = d.params();
      p.checkpoint_every = kEvery, p.checkpoints = d_cks, p.checkpoint_dtype = DType::kF32, p.num_checkpoints = count;
      EXPECT_TRUE(fused_serves(p));
      forward_call(d, p, launch);
      cudaMemcpy(cks.bytes.data(), d_cks, cks.bytes.size(), cudaMemcpyDeviceToHost);
      EXPECT_TRUE(cks.guard_intact());
      EXPECT_EQ(test::count_nonfinite(in.out.values()), 0);
      EXPECT_EQ(test::count_nonfinite(in.final_state.values()), 0);
      EXPECT_EQ(test::count_nonfinite(cks.values()), 0) << "checkpoints left unwritten";
      std::vector<unsigned char> b = out_and_state_bits(in);
      b.insert(b.end(), cks.bytes.begin(), cks.bytes.end());
      return b;
    };
    const std::vector<unsigned char> want = bits(fused ? always : never), other = bits(fused ? never : always);
    EXPECT_FALSE(want == other) << "the fused kernel and today's kernels gave the same bits";
    EXPECT_TRUE(bits({}) == want) << (fused ? "the rule did not give the call to the fused kernel"
                                            : "the rule gave the call to the fused kernel");
  }
}

// Where K0 gives the call to the fused kernel (device cu_seqlens; ~3 sequences an SM of mixed lengths,
// empty and short ones among them), the rule's launch on the verdict gives the bits of the fused
// kernel forced; every entry written, graph replays equal; through a pool with padding entries among
// the sequences, the forced kernel's outputs and pool, the padding rows zero. (This was the test of a
// persistent grid taking several items a CTA, dropped in session 30.)
TEST_F(Prefill32Gpu, RuleOnVerdictWithMixedLengthsAndPadding) {
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  constexpr int64_t H = 8;
  const int64_t N = 3 * sms / H + 7;  // ~3 (sequence, head) items an SM
  const int64_t cycle[] = {512, 700, 0, 96, 1024, 33};
  std::vector<int64_t> lens;
  for (int64_t n = 0; n < N; ++n) lens.push_back(cycle[n % 6]);
  int64_t total32 = 0;
  for (const int64_t l : lens) total32 += (l + 31) / 32;
  ASSERT_GE(3 * H * total32, 2 * int64_t(sms) * (1024 / 32)) << "the rule must hold: the lengths need more chunks";
  internal::PrefillLaunch always;
  always.fused_v2 = 1;
  {
    KdaOptions o;
    o.seqlens = lens, o.cu_dtype = DType::kI32, o.H = H, o.seed = 23;
    o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
    KdaInputs in(o);
    SCOPED_TRACE(in.describe());
    DeviceProblem d_always(in, always), d_rule(in);
    const std::vector<unsigned char> bits = run_bits(in, d_rule);
    EXPECT_EQ(test::count_nonfinite(in.out.values()), 0);
    EXPECT_EQ(test::count_nonfinite(in.final_state.values()), 0);
    EXPECT_TRUE(bits == run_bits(in, d_always)) << "the rule's launch's bits differ from the forced fused kernel's";
    EXPECT_TRUE(bits == graph_replay_bits(in, d_rule)) << "graph replays of the rule's launch differ";
  }
  {  // a pool: fp32 slots of random states, sequences n in slot (n + 2) % P, every fifth one padding
    KdaOptions o;
    o.seqlens = lens, o.H = H, o.seed = 29;
    KdaInputs in(o);
    DeviceProblem d(in);
    const int64_t P = N + 2;
    TestPool pool(P, size_t(H) * o.V * o.K);
    std::vector<int32_t> slots(N);
    for (int64_t n = 0; n < N; ++n) slots[n] = n % 5 == 1 ? -1 : int32_t((n + 2) % P);
    void* d_slots = d.upload(slots.data(), slots.size() * 4);
    auto run_pool = [&](const internal::PrefillLaunch& launch) {  // the outputs' bytes, then the pool's
      pool.run(d, d_slots, launch);
      return pool.bits(in);
    };
    const std::vector<unsigned char> bits = run_pool({});
    EXPECT_EQ(test::count_nonfinite(in.out.values()), 0);
    const size_t row = size_t(H) * o.V * 2;  // bytes of a token's bf16 outputs
    int64_t bos = 0;
    for (int64_t n = 0; n < N; bos += lens[n], ++n)
      if (slots[n] < 0) {
        const auto first = in.out.bytes.begin() + std::ptrdiff_t(bos * int64_t(row));
        EXPECT_TRUE(std::all_of(first, first + std::ptrdiff_t(lens[n] * int64_t(row)), [](unsigned char x) { return x == 0; }))
            << "padding sequence " << n << ": output rows not zero";
      }
    EXPECT_TRUE(bits == run_pool(always)) << "pool: the rule's outputs or pool differ from the forced kernel's";
  }
}

// The candidate internal fused_min_tokens moves the rule's 64-token floor: sequences of 256 tokens
// take the fused kernel by the rule (the forced kernel's bits) and the chunk-16 kernels under a
// 512-token floor, both where the host decides (B equal sequences, no cu_seqlens) and where K0 does
// (device cu_seqlens).
TEST_F(Prefill32Gpu, RuleFloorOptionMovesTheEdge) {
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  constexpr int64_t H = 8;
  const int64_t n = (2 * int64_t(sms) + 3 * H - 1) / (3 * H);  // 3 N H >= 2 SMs
  internal::PrefillLaunch always, never, floor;
  always.fused_v2 = 1, never.fused_v2 = -1, floor.fused_min_tokens = 512;
  for (const bool device_cu : {false, true}) {
    KdaOptions o;
    if (device_cu) o.seqlens = std::vector<int64_t>(n, 256), o.cu_dtype = DType::kI32;
    else o.B = n, o.T = 256;
    o.H = H, o.seed = 31;
    o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
    KdaInputs in(o);
    SCOPED_TRACE(in.describe());
    DeviceProblem d_rule(in), d_floor(in, floor), d_always(in, always), d_never(in, never);
    ASSERT_TRUE(fused_serves(d_rule.params()));
    const std::vector<unsigned char> fused = run_bits(in, d_always), today = run_bits(in, d_never);
    EXPECT_FALSE(fused == today) << "the fused kernel and today's kernels gave the same bits";
    EXPECT_TRUE(run_bits(in, d_rule) == fused) << "the rule's 64-token floor left 256 tokens to the chunk-16 kernels";
    EXPECT_TRUE(run_bits(in, d_floor) == today) << "256 tokens took the fused kernel under a 512-token floor";
    EXPECT_EQ(test::count_nonfinite(in.out.values()), 0);
  }
}

// The fused kernel through the library's call as the other prefill paths are tested: a NaN gate
// reaches its head's final state and no other head's; a CUDA graph's replays give the eager call's
// bits.
TEST_F(Prefill32Gpu, FusedNonFiniteGateAndGraphReplay) {
  internal::PrefillLaunch always;
  always.fused_v2 = 1;
  {
    KdaOptions o;
    o.T = 40, o.H = 2, o.final_state = StateKind::kF32;
    KdaInputs in(o);
    in.g.set((20 * o.H + 1) * o.K + 3, double(NAN));  // token 20, head 1, channel 3
    DeviceProblem d(in, always);
    ASSERT_TRUE(fused_serves(d.params()));
    run_bits(in, d);
    const std::vector<double> fs = in.final_state.values();
    int64_t bad0 = 0, bad1 = 0;
    for (int64_t i = 0; i < o.V * o.K; ++i) {
      bad0 += std::isfinite(fs[i]) ? 0 : 1;
      bad1 += std::isfinite(fs[o.V * o.K + i]) ? 0 : 1;
    }
    EXPECT_GT(bad1, 0) << "a NaN gate left its head's final state finite";
    EXPECT_EQ(bad0, 0) << "a NaN gate reached another head";
  }
  {
    KdaOptions o;
    o.T = 301, o.H = 3, o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
    KdaInputs in(o);
    DeviceProblem d(in, always);
    const std::vector<unsigned char> eager = run_bits(in, d);
    EXPECT_TRUE(eager == graph_replay_bits(in, d)) << "a graph replay's bits differ from the eager call's";
  }
}

// A sequence of 131072 tokens through the fused kernel (4096 chunks in one CTA's chain).
TEST_F(Prefill32Gpu, FusedVeryLongSequence131072) {
  KdaOptions o;
  o.T = 131072, o.H = 1, o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
  KdaInputs in(o);
  SCOPED_TRACE(in.describe());
  fused_call_against_reference(in, "fused32 launch T=131072");
}

// T=8192, H=96, one sequence, fp32 final state: fused, and producer + recurrence, against today's default
// prefill (internal::forward), same inputs, medians of 20 after a warm-up; first every v2 path's
// outputs compared bit for bit.
// The chunk timeline (FusedArgs::chunk_trace) of the traced heads' steady chunks (4 .. n - 3): each
// side's wait and work a chunk (mean and spread; the producer's work to its last warp's arrival, the
// consumers' to their last warp's release), how far the other warps trail the timed thread's warp, the
// hand-overs (the producer's last arrival to the consumers' wake-up, the consumers' last release of
// the stage to the producer's), the period, and how often both sides waited on the same chunk: in a
// two-stage ring with steady chunk times only one side waits.
void print_chunk_trace(const std::vector<long long>& tr, int64_t chunks, int heads, const std::string& label) {
  const int64_t n = std::min<int64_t>(chunks, kTraceChunks);
  // Too few chunks, or a variant the kernel does not trace (the buffer left zero).
  if (n < 12 || std::all_of(tr.begin(), tr.end(), [](long long x) { return x == 0; })) return;
  const auto at = [&](int h, int64_t c, int p) { return double(tr[(size_t(h) * kTraceChunks + c) * kTracePoints + p]); };
  const auto latest = [&](int h, int64_t c, int first, int count) {  // the last of points first .. first + count - 1
    double x = at(h, c, first);
    for (int i = 1; i < count; ++i) x = std::max(x, at(h, c, first + i));
    return x;
  };
  struct Stat {
    double sum = 0, sq = 0, n = 0;
    void add(double x) { sum += x, sq += x * x, ++n; }
    double mean() const { return n ? sum / n : 0.0; }
    double sd() const { return std::sqrt(std::max(0.0, n ? sq / n - mean() * mean() : 0.0)); }
  };
  Stat pw, pwork, ptrail, cw, cwork, ctrail, cskew, to_cons, to_prod, period;
  int both = 0, steady = 0;
  for (int h = 0; h < heads; ++h) {
    for (int64_t c = 4; c < n - 2; ++c) {
      const double p_done = latest(h, c, 2, 4), c_done = latest(h, c, 9, 8);
      const double freed = latest(h, c - 2, 9, 8);  // the stage chunk c fills, as the consumers left it
      const double p_wait = at(h, c, 1) - at(h, c, 0), c_wait = at(h, c, 7) - at(h, c, 6);
      pw.add(p_wait), pwork.add(p_done - at(h, c, 1)), ptrail.add(p_done - at(h, c, 2));
      cw.add(c_wait), cwork.add(c_done - at(h, c, 7)), ctrail.add(c_done - at(h, c, 9));
      cskew.add(at(h, c, 8) - at(h, c, 7));
      if (p_wait > 100) to_prod.add(at(h, c, 1) - freed);
      if (c_wait > 100) to_cons.add(at(h, c, 7) - p_done);
      both += p_wait > 300 && c_wait > 300;
      ++steady;
    }
    period.add((latest(h, n - 3, 2, 4) - latest(h, 4, 2, 4)) / double(n - 7));
  }
  std::printf("[ measure  ] chunk timeline%s (cycles, %d heads x chunks 4..%lld, mean/sd): period %.0f; producer "
              "empty wait %.0f/%.0f, work %.0f/%.0f, its last warp %.0f/%.0f after warp 0; consumers full wait "
              "%.0f/%.0f, work %.0f/%.0f, their last warp's release %.0f/%.0f after warp 0's, warpgroup 1 woken "
              "%.0f/%.0f after warpgroup 0; hand-over to the consumers %.0f (%g chunks), to the producer %.0f (%g "
              "chunks); both sides waited > 300 on %d of %d chunks\n",
              label.c_str(), heads, static_cast<long long>(n - 3), period.mean(), pw.mean(), pw.sd(), pwork.mean(),
              pwork.sd(), ptrail.mean(), ptrail.sd(), cw.mean(), cw.sd(), cwork.mean(), cwork.sd(), ctrail.mean(),
              ctrail.sd(), cskew.mean(), cskew.sd(), to_cons.mean(), to_cons.n, to_prod.mean(), to_prod.n, both, steady);
  std::printf("[ measure  ] chunk timeline%s, head 0, chunks 4..15 (producer wait+work | consumers wait+work):",
              label.c_str());
  for (int64_t c = 4; c < std::min<int64_t>(16, n - 2); ++c)
    std::printf(" %.0f+%.0f|%.0f+%.0f", at(0, c, 1) - at(0, c, 0), latest(0, c, 2, 4) - at(0, c, 1),
                at(0, c, 7) - at(0, c, 6), latest(0, c, 9, 8) - at(0, c, 7));
  std::printf("\n");
}

// Where the fused kernel's cycles go (clock64 sums per chunk, averaged over the heads) for the call
// `f` describes (its produce and consume arguments and flags; FusedArgs::phase_clocks and chunk_trace
// set here): the chunk timeline where the kernel wrote one (the rule's flags' variants), then one line
// of the producer's phases (its thread 0) and the consumers' (their thread 0).
void print_phase_clocks(FusedArgs f, const std::string& label) {
  const int H = f.consume.H;
  long long* clocks = nullptr;
  long long* trace = nullptr;
  const size_t trace_len = size_t(kTraceHeads) * kTraceChunks * kTracePoints;
  ASSERT_EQ(cudaMalloc(&clocks, sizeof(long long) * kPhaseClocks * H), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&trace, sizeof(long long) * trace_len), cudaSuccess);
  ASSERT_EQ(cudaMemset(trace, 0, sizeof(long long) * trace_len), cudaSuccess);
  f.phase_clocks = clocks, f.chunk_trace = trace;
  ASSERT_EQ(fused_chunks(f, nullptr), cudaSuccess);
  std::vector<long long> sums(size_t(kPhaseClocks) * H), tr(trace_len);
  ASSERT_EQ(cudaMemcpy(sums.data(), clocks, sizeof(long long) * sums.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(tr.data(), trace, sizeof(long long) * trace_len, cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(clocks), cudaFree(trace);
  print_chunk_trace(tr, (f.consume.T + kChunk - 1) / kChunk, std::min(H, kTraceHeads), label);
  const char* names[kPhaseClocks] = {"empty wait", "load", "normalise", "scan", "factors", "L/Mqk wgmma",
                                     "L/Mqk stores", "inverse products and stores", "arrive+loop", "gate", "full wait",
                                     "recurrence", "out stores+release", "inverse", "inverse substitution", "chunks"};
  std::printf("[ measure  ] fused kernel%s, cycles per chunk (T=%lld H=%d, mean over heads), producer:", label.c_str(),
              static_cast<long long>(f.consume.T), H);
  for (int i : {0, 1, 9, 2, 3, 4, 5, 6, 14, 7, 8, 10, 13, 11, 12}) {
    double mean = 0;
    for (int h = 0; h < H; ++h)
      mean += double(sums[size_t(h) * kPhaseClocks + i]) / double(sums[size_t(h) * kPhaseClocks + 15]);
    std::printf(" %s %.0f%s", names[i], mean / H, i == 8 ? "; consumers:" : i == 12 ? "" : ",");
  }
  std::printf("\n");
}

// The median of 20 event-timed runs of fn (after one unmeasured) on `stream`, ms.
template <class Fn>
double median_event_ms(Fn&& fn, cudaStream_t stream = nullptr) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start), cudaEventCreate(&stop);
  fn();
  std::vector<float> ms(20);
  for (auto& m : ms) {
    cudaEventRecord(start, stream);
    fn();
    cudaEventRecord(stop, stream);
    cudaEventSynchronize(stop);
    cudaEventElapsedTime(&m, start, stop);
  }
  cudaEventDestroy(start), cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return double(ms[ms.size() / 2]);
}

TEST_F(Prefill32Gpu, TimeAtServingShape) {
  KdaOptions o;
  o.T = 8192, o.H = 96, o.final_state = StateKind::kF32, o.seed = 11;
  KdaInputs in(o);
  internal::PrefillLaunch today;  // the chunk-16 kernels (the rule would run the fused kernel here)
  today.fused_v2 = -1;
  DeviceProblem d(in, today);
  V2Call v2(d);
  const auto median_ms = [](auto&& fn) { return median_event_ms(fn); };
  // Every path's outputs at this shape, bit for bit (no reference: too long for the host).
  std::vector<unsigned char> bits[V2Call::kModes];
  for (int mode = 0; mode < V2Call::kModes; ++mode) {
    d.poison();
    v2.run(mode);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    d.download();
    bits[mode] = in.out.bytes;
    EXPECT_EQ(test::count_nonfinite(in.out.values()), 0) << V2Call::kModeTable[mode].name;
  }
  for (int mode = 1; mode < V2Call::kModes; ++mode)
    EXPECT_TRUE(bits[0] == bits[mode]) << "fused mode " << mode << ": the output differs from the two kernels'";
  const double t_today = median_ms([&] { d.run(); });
  const double t_v2 = median_ms([&] { v2.run(0); });
  const double t_fused = median_ms([&] { v2.run(1); });
  const double t_staged = median_ms([&] { v2.run(2); });
  FusedArgs consumers_only;
  consumers_only.produce = v2.pa, consumers_only.consume = v2.ca;
  consumers_only.time_consumers_only = true;
  std::printf("[ measure  ] prefill32 T=8192 H=96 candidates (ms):");
  for (int mode = 3; mode < V2Call::kModes; ++mode)
    std::printf(" %s%.3f%s", V2Call::kModeTable[mode].name, median_ms([&] { v2.run(mode); }),
                mode + 1 < V2Call::kModes ? ";" : "\n");
  {  // the rule's flags with the gate and the row scales interleaved (the default) and as two phases apart,
     // timed in turn (three rounds) after the bit check
    const auto run_apart = [&] {  // the fused modes read v2.pa alone (no records)
      v2.pa.gate_then_norms = true;
      v2.run(6);
      v2.pa.gate_then_norms = false;
    };
    d.poison();
    run_apart();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    d.download();
    EXPECT_TRUE(in.out.bytes == bits[0]) << "the gate and row scales apart: the output differs from the two kernels'";
    std::printf("[ measure  ] prefill32 T=8192 H=96 rule's flags, gate and row scales interleaved / apart (ms):");
    for (int round = 0; round < 3; ++round)
      std::printf(" %.3f / %.3f%s", median_ms([&] { v2.run(6); }), median_ms(run_apart), round < 2 ? ";" : "\n");
  }
  const double t_consumers = median_ms([&] { ASSERT_EQ(fused_chunks(consumers_only, nullptr), cudaSuccess); });
  const double t_produce = median_ms([&] { ASSERT_EQ(produce_chunks(v2.pa, nullptr), cudaSuccess); });
  const double t_consume = median_ms([&] { ASSERT_EQ(consume_chunks(v2.ca, nullptr), cudaSuccess); });
  // Where the fused kernel's cycles go in eight variants (inputs loaded or staged by TMA, setmaxnreg
  // or not, the consumers inverting or not), and the rule's flags with the gate and row scales apart.
  for (int variant = 0; variant < 9; ++variant) {  // 8: the rule's flags, the gate and row scales apart
    const bool staged = variant & 1 || variant == 8, regs = variant & 2 || variant == 8, cinv = variant & 4 || variant == 8;
    FusedArgs clocked;
    clocked.produce = v2.pa, clocked.consume = v2.ca, clocked.stage_inputs = staged;
    clocked.produce.gate_then_norms = variant == 8;
    clocked.producer_regs = regs;
    clocked.consumer_inverse = cinv;
    print_phase_clocks(clocked, std::string(staged ? " (staged inputs)" : "") + (regs ? " (setmaxnreg 184 / 160)" : "") +
                                    (cinv ? " (inverting consumers)" : "") +
                                    (variant == 8 ? " (gate and row scales apart)" : ""));
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::printf("[ measure  ] prefill32 T=8192 H=96: fused %.3f ms, fused with staged inputs %.3f ms, the fused "
              "kernel's consumers alone %.3f ms; producer + recurrence %.3f ms (producer %.3f, recurrence %.3f); "
              "today's prefill %.3f ms\n",
              t_fused, t_staged, t_consumers, t_v2, t_produce, t_consume, t_today);
}

// One sequence in bench_prefill.py's two gate regimes, fp32 states: random (raw gates of N(0, 1)'s
// spread, here uniform in [-1.73, 1.73], A_log and dt_bias in [0, 1]) and long memory (the same with
// channels 0-7 of every head at dt_bias -8).
KdaInputs bench_regime_inputs(int64_t T, int64_t H, uint64_t seed, bool long_memory) {
  KdaOptions o;
  o.T = T, o.H = H, o.seed = seed;
  o.initial_state = StateKind::kF32, o.final_state = StateKind::kF32;
  o.A_log_min = 0.0, o.A_log_max = 1.0, o.dt_bias_min = 0.0, o.dt_bias_max = 1.0, o.g_min = -1.73, o.g_max = 1.73;
  KdaInputs in(o);
  if (long_memory)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t c = 0; c < 8; ++c) in.dt_bias[h * o.K + c] = -8.f;
  return in;
}

// The median of 20 CUDA-graph replays of d's call (captured once), ms.
double median_graph_ms(KdaInputs& in, DeviceProblem& d) {
  CapturedCall call(in, d);
  return median_event_ms([&] { EXPECT_EQ(cudaGraphLaunch(call.exec, call.stream), cudaSuccess); }, call.stream);
}

// The rule's call at issue 11's shape (T=8192 H=96, one sequence, fp32 states) in bench_prefill.py's
// two gate regimes (random: raw gates of N(0, 1)'s spread, here uniform in [-1.73, 1.73], A_log and
// dt_bias in [0, 1]; long memory: the same with channels 0-7 of every head at dt_bias -8), against
// what it is made of: the unsplit fused kernel (internal fused_v2 = 1), the pieces' kernel with one
// chained piece (fused_pieces = 1, fused_chain = 1: the whole sequence in one CTA a head, as the
// unsplit kernel, through the pieces' path and its prelude) and four chained pieces (what the rule
// takes here). CUDA-graph medians of 20 replays, as the benchmark's, so that the pieces' cost with
// long memory (run 161: 1.039 ms against 0.967 unsplit) splits into the pieces' path and their
// chaining. Each variant's outputs within 1e-3 of the unsplit kernel's (the chained state differs
// by power-of-two row scales only).
TEST_F(Prefill32Gpu, TimeTheRuleAtServingShape) {
  for (const bool long_memory : {false, true}) {
    KdaInputs in = bench_regime_inputs(8192, 96, 13, long_memory);
    internal::PrefillLaunch unsplit, one_piece, four_pieces;
    unsplit.fused_v2 = 1;
    one_piece.fused_pieces = 1, one_piece.fused_chain = 1;
    four_pieces.fused_pieces = 4, four_pieces.fused_chain = 1;
    DeviceProblem d_rule(in), d_unsplit(in, unsplit), d_one(in, one_piece), d_four(in, four_pieces);
    run_bits(in, d_unsplit);
    const std::vector<double> reference = in.out.values();
    const char* const names[] = {"the rule", "one piece", "four chained pieces"};
    DeviceProblem* const calls[] = {&d_rule, &d_one, &d_four};
    for (int i = 0; i < 3; ++i) {
      run_bits(in, *calls[i]);
      EXPECT_EQ(test::count_nonfinite(in.out.values()), 0) << names[i];
      EXPECT_LE(test::rel_rms(in.out.values(), reference), 1e-3) << names[i];
    }
    std::printf("[ measure  ] T=8192 H=96 one sequence, %s gates, CUDA-graph medians (ms): the rule %.3f, unsplit %.3f, "
                "one chained piece %.3f, four chained pieces %.3f\n",
                long_memory ? "long-memory" : "random", median_graph_ms(in, d_rule), median_graph_ms(in, d_unsplit),
                median_graph_ms(in, d_one), median_graph_ms(in, d_four));
  }
}

// Where the few-head pieces' kernel spends a call beyond its chunks (runs 123 and 169: ~15-25 us a
// call at H = 12 that the chunks a piece walks do not account for): each pieces CTA's timeline from
// FusedArgs::piece_stamps (%globaltimer) in a CUDA-graph replay, one sequence at H = 12 with
// bench_prefill.py's random gates, the rule's piece count. Checks that the stamps change no bit and
// that every CTA's points come in order; prints, in microseconds from the first CTA's start: the
// CTAs' start spread, the consumers' set-up (gates' pre-check, state), the first full stage (the
// producer's first chunk), the warm-up with the chunk after it, the cost a chunk after that, the
// final state's stores and the kernel's end, and the last CTA's timeline. Twice: replayed after a
// replay (at T = 2048 the call's inputs and code stay in L2 from one to the next, from T = 8192 they do
// not fit) and after 256 MB written to a buffer of its own (L2 flushed), so that the first chunks'
// cost splits into what L2 residency saves and what a cold SM pays anyway (run 171: the first full stage
// at ~15 us at T = 2048 against ~19-21 from T = 8192, whatever the start candidates did); and a third
// time flushed with a T = 2048 call of the same kernel on other inputs just before (the code warm in L2
// and in the SMs' instruction caches, the data cold), which splits the cold start into code and data.
TEST_F(Prefill32Gpu, TimeThePiecesCtaByCta) {
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  DeviceBuffer flush(size_t(256) << 20);
  ASSERT_NE(flush.ptr, nullptr);
  for (const int64_t T : {int64_t(2048), int64_t(8192), int64_t(32768)}) {
    KdaInputs in = bench_regime_inputs(T, 12, 29, false);
    const KdaOptions& o = in.opt;
    const int64_t pieces = prefill::fused_few_head_pieces(o.H, 1, (T + 31) / 32, sms);
    ASSERT_GT(pieces, 1) << "T=" << T;
    const int64_t ctas = pieces * o.H;
    DeviceBuffer stamps(size_t(ctas * kPieceStamps) * sizeof(long long));
    ASSERT_NE(stamps.ptr, nullptr);
    DeviceProblem d_plain(in);
    ASSERT_TRUE(fused_pieces_serve(d_plain.params()));
    const std::vector<unsigned char> plain = run_bits(in, d_plain);
    internal::PrefillLaunch stamped;
    stamped.piece_stamps = static_cast<long long*>(stamps.ptr);
    DeviceProblem d_stamped(in, stamped);
    CapturedCall call(in, d_stamped);
    // the code-warm variant's call before: the rule at T = 2048 on inputs of its own (its pieces run the same kernel)
    KdaInputs in_warm = bench_regime_inputs(2048, 12, 31, false);
    DeviceProblem d_warm(in_warm);
    CapturedCall warm_call(in_warm, d_warm);
    for (const int variant_i : {0, 1, 2}) {
      const bool flushed = variant_i > 0;
      const CapturedCall* const warm = variant_i == 2 ? &warm_call : nullptr;
      const char* const variant = variant_i == 0 ? "after a replay" : variant_i == 1 ? "L2 flushed" : "L2 flushed, code warm";
      (void)call.replay(5, flushed ? &flush : nullptr, warm);  // warm
      ASSERT_EQ(cudaMemset(stamps.ptr, 0, stamps.bytes), cudaSuccess);
      EXPECT_TRUE(call.replay(1, flushed ? &flush : nullptr, warm) == plain) << "T=" << T << ": the stamps changed the bits";
      std::vector<long long> st(size_t(ctas * kPieceStamps));
      ASSERT_EQ(cudaMemcpy(st.data(), stamps.ptr, stamps.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
      const auto at = [&](int64_t i, int point) { return st[size_t(i * kPieceStamps + point)]; };
      long long t0 = at(0, 0), t_end = 0;
      int64_t last = 0;
      for (int64_t i = 0; i < ctas; ++i) {
        for (int point = 1; point <= 5; ++point)
          EXPECT_LE(at(i, point - 1), at(i, point)) << "T=" << T << " CTA " << i << " point " << point;
        EXPECT_GT(at(i, 7), 0) << "T=" << T << " CTA " << i << ": no chunks";
        t0 = std::min(t0, at(i, 0));
        const long long end = std::max(at(i, 5), at(i, 6));
        if (end > t_end) t_end = end, last = i;
      }
      double sum[6] = {}, most[6] = {}, per_chunk = 0, per_chunk_max = 0, start_max = 0;
      for (int64_t i = 0; i < ctas; ++i) {
        const double d[6] = {1e-3 * double(at(i, 1) - at(i, 0)), 1e-3 * double(at(i, 2) - at(i, 0)),
                             1e-3 * double(at(i, 3) - at(i, 2)), 1e-3 * double(at(i, 4) - at(i, 3)),
                             1e-3 * double(at(i, 5) - at(i, 4)), 1e-3 * double(at(i, 6) - at(i, 4))};
        for (int j = 0; j < 6; ++j) sum[j] += d[j], most[j] = std::max(most[j], d[j]);
        const int64_t own = at(i, 7) - at(i, 8) - 1;  // the chunks of the main phase
        if (own > 0) {
          const double pc = d[3] / double(own);
          per_chunk += pc / double(ctas), per_chunk_max = std::max(per_chunk_max, pc);
        }
        start_max = std::max(start_max, 1e-3 * double(at(i, 0) - t0));
      }
      const auto mean = [&](int j) { return sum[j] / double(ctas); };
      std::printf("[ measure  ] pieces (%s) T=%lld H=12 random gates, %lld pieces, %lld CTAs (us, mean / max): start "
                  "spread %.2f; consumers set up %.2f / %.2f; first full stage %.2f / %.2f; warm-up and its next chunk "
                  "%.2f / %.2f; a chunk after them %.3f / %.3f; final state %.2f / %.2f; producer's end after the "
                  "consumers' %.2f / %.2f; kernel %.1f\n",
                  variant, (long long)T, (long long)pieces, (long long)ctas, start_max, mean(0), most[0], mean(1),
                  most[1], mean(2), most[2], per_chunk, per_chunk_max, mean(4), most[4], mean(5), most[5],
                  1e-3 * double(t_end - t0));
      std::printf("[ measure  ] pieces (%s) T=%lld: the last CTA (head %lld, row %lld, SM %lld, %lld chunks, warm-up "
                  "%lld): start %.2f, set up %.2f, first stage %.2f, own chunks from %.2f, last chunk done %.2f, end "
                  "%.2f us\n",
                  variant, (long long)T, (long long)(last % o.H), (long long)(last / o.H), at(last, 9), at(last, 7),
                  at(last, 8), 1e-3 * double(at(last, 0) - t0), 1e-3 * double(at(last, 1) - t0),
                  1e-3 * double(at(last, 2) - t0), 1e-3 * double(at(last, 3) - t0), 1e-3 * double(at(last, 4) - t0),
                  1e-3 * double(t_end - t0));
    }
    std::printf("[ measure  ] pieces (rule) T=%lld H=12: CUDA-graph median %.4f ms\n", (long long)T,
                median_graph_ms(in, d_stamped));
  }
}

// Where the few-head pieces' first chunk spends its time after the gates' pre-check, by the pieces'
// start stamps (internal pieces_start = 1, a kernel of its own: the rule's SASS unchanged;
// FusedArgs::start_stamps: the producer's start, its gate constants and barrier, the staged rows'
// issue, the verdict and whether chunk 0's rows had landed by then, chunk 0's rows landed and its
// factors done; the consumers' verdict handed over and their first full stage), and the producer's steps
// in chunks 0 and 1 side by side. One sequence, H = 12, bench_prefill.py's random gates, T = 2048 and
// 8192: the stamped kernel's bits are the rule's; its timelines (us from each CTA's start, mean over the
// CTAs that ran a chunk: an empty last piece, on GPUs of other SM counts, has none) after a replay, with
// L2 flushed (256 MB written before each replay), and flushed with the stamped kernel's code warm (a
// T = 2048 call of it on inputs of its own just before, as TimeThePiecesCtaByCta's third mode); then
// the same for pieces_start = 2, chunk 0's producer steps run twice and the second pass stamped (its
// "load" step holds the whole first pass), 3 (the consumers' waits for a full stage with a ~1 ms suspend
// hint) and 4 (their waits by polls 256 ns apart).
// Run 174 (an H100): chunk 0's steps ~3x chunk 1's wherever the call's data had left L2, code warm or
// not, and ~1.25x where a replay had left it there (DESIGN.md "Where a few-head call's fixed cost goes");
// run 175: as much with every line of the kernel's parameters read before the verdict (not the cause);
// run 177: chunk 0's second pass as slow as its first, while chunk 1, at the same time from the kernel's
// start, runs at its steady speed: the producer is slow while the consumers wait for their first stage
// (3 and 4 test whether their polling is what slows it).
TEST_F(Prefill32Gpu, TimeThePiecesStart) {
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  DeviceBuffer flush(size_t(256) << 20);
  ASSERT_NE(flush.ptr, nullptr);
  for (const int64_t T : {int64_t(2048), int64_t(8192)}) {
    KdaInputs in = bench_regime_inputs(T, 12, 29, false);
    const int64_t pieces = prefill::fused_few_head_pieces(in.opt.H, 1, (T + 31) / 32, sms);
    ASSERT_GT(pieces, 1) << "T=" << T;
    const int64_t ctas = pieces * in.opt.H;
    DeviceProblem d_rule(in);
    ASSERT_TRUE(fused_pieces_serve(d_rule.params()));
    const std::vector<unsigned char> rule = run_bits(in, d_rule);
    DeviceBuffer piece_st(size_t(ctas * kPieceStamps) * sizeof(long long));
    DeviceBuffer start_st(size_t(ctas * kStartStamps) * sizeof(long long));
    ASSERT_TRUE(piece_st.ptr != nullptr && start_st.ptr != nullptr);
    internal::PrefillLaunch launch;
    launch.piece_stamps = static_cast<long long*>(piece_st.ptr);
    launch.start_stamps = static_cast<long long*>(start_st.ptr);
    // pieces_start 1 to 4: the stamped kernel; chunk 0's producer steps run twice, the second stamped; the
    // consumers' waits for a full stage with a long suspend hint; those waits by polls 256 ns apart
    const char* const variant_names[] = {"", ", chunk 0 twice", ", long waits", ", backed-off waits"};
    std::vector<std::unique_ptr<DeviceProblem>> problems;
    std::vector<std::unique_ptr<CapturedCall>> calls;
    for (int variant = 1; variant <= 4; ++variant) {
      launch.pieces_start = variant;
      problems.push_back(std::make_unique<DeviceProblem>(in, launch));
      EXPECT_TRUE(run_bits(in, *problems.back()) == rule)
          << "T=" << T << " start stamps" << variant_names[variant - 1] << ": not the rule's bits";
      calls.push_back(std::make_unique<CapturedCall>(in, *problems.back()));
    }
    // the code-warm mode's call before: the stamped kernel at T = 2048 on inputs of its own, so that the code
    // is in L2 (and in the SMs' caches, as far as they keep it from one kernel to the next) and the data not
    KdaInputs in_warm = bench_regime_inputs(2048, 12, 31, false);
    internal::PrefillLaunch warm_launch;
    warm_launch.pieces_start = 1;
    DeviceProblem d_warm(in_warm, warm_launch);
    CapturedCall warm_call(in_warm, d_warm);
    for (int k = 0; k < 12; ++k) {  // each kernel (pieces_start 1 to 4) in the three modes
      const int variant = 1 + k / 3, mode = k % 3;
      CapturedCall& call = *calls[size_t(variant - 1)];
      const bool flushed = mode > 0;
      const CapturedCall* const warm = mode == 2 ? &warm_call : nullptr;
      const std::string mode_name =
          std::string(mode == 0 ? "after a replay" : mode == 1 ? "L2 flushed" : "L2 flushed, code warm") +
          variant_names[variant - 1];
      (void)call.replay(5, flushed ? &flush : nullptr, warm);
      ASSERT_EQ(cudaMemset(piece_st.ptr, 0, piece_st.bytes), cudaSuccess);
      ASSERT_EQ(cudaMemset(start_st.ptr, 0, start_st.bytes), cudaSuccess);
      EXPECT_TRUE(call.replay(1, flushed ? &flush : nullptr, warm) == rule) << "T=" << T << " start stamps";
      std::vector<long long> ps(size_t(ctas * kPieceStamps)), st(size_t(ctas * kStartStamps));
      ASSERT_EQ(cudaMemcpy(ps.data(), piece_st.ptr, piece_st.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(st.data(), start_st.ptr, start_st.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
      double mean[kStartStamps] = {}, first_full = 0, steady = 0;
      double step[2][8] = {};  // chunks 0 and 1: produce_chunk's steps (start points 9 + 8 c + j)
      int64_t ran = 0, landed = 0, with_own = 0, two_chunks = 0;
      long long t0 = 0, t_end = 0;
      for (int64_t i = 0; i < ctas; ++i) {
        const long long* const p_row = &ps[size_t(i * kPieceStamps)];
        const long long* const s_row = &st[size_t(i * kStartStamps)];
        if (s_row[0] == 0) continue;  // no chunk (an empty piece)
        ++ran;
        for (int j = 0; j < 8; ++j) {
          EXPECT_GT(s_row[j], 0) << "T=" << T << " CTA " << i << ": start point " << j << " not reached";
          mean[j] += 1e-3 * double(s_row[j] - p_row[0]);
        }
        landed += s_row[8];
        if (s_row[9 + 8 + 7] > 0) {  // chunk 1's steps reached: step j from the step before (chunk 0's
          // load from its rows' wait, point 4; chunk 1's from chunk 0's hand-over, step 7: its loop top)
          ++two_chunks;
          for (int c = 0; c < 2; ++c)
            for (int j = 0; j < 8; ++j) {
              const long long before = j > 0 ? s_row[9 + 8 * c + j - 1] : c == 0 ? s_row[4] : s_row[9 + 7];
              step[c][j] += 1e-3 * double(s_row[9 + 8 * c + j] - before);
            }
        }
        first_full += 1e-3 * double(p_row[2] - p_row[0]);
        const int64_t own = p_row[7] - p_row[8] - 1;
        if (own > 0) steady += 1e-3 * double(p_row[4] - p_row[3]) / double(own), ++with_own;
        t0 = t0 == 0 ? p_row[0] : std::min(t0, p_row[0]), t_end = std::max(t_end, std::max(p_row[5], p_row[6]));
      }
      ASSERT_GT(ran, 0) << "T=" << T << ": no CTA stamped its start";
      for (double& m : mean) m /= double(ran);
      std::printf("[ measure  ] pieces start (%s) T=%lld H=12 random, %lld of %lld CTAs (us from each CTA's "
                  "start, mean): producer start %.2f, gate constants and barrier %.2f, rows issued %.2f, verdict "
                  "%.2f (consumers handed it over %.2f; chunk 0's rows landed by then in %lld CTAs), chunk 0 rows "
                  "waited for %.2f, chunk 0 factors %.2f, first full stage %.2f (piece stamp %.2f); steady chunk "
                  "%.3f; kernel %.1f\n",
                  mode_name.c_str(),
                  (long long)T, (long long)ran, (long long)ctas, mean[0], mean[1], mean[2], mean[3], mean[6],
                  (long long)landed, mean[4], mean[5], mean[7], first_full / double(ran),
                  with_own > 0 ? steady / double(with_own) : 0.0, 1e-3 * double(t_end - t0));
      ASSERT_GT(two_chunks, 0) << "T=" << T << ": no CTA stamped chunk 1's steps";
      for (int c = 0; c < 2; ++c) {
        const auto m = [&](int j) { return step[c][j] / double(two_chunks); };
        std::printf("[ measure  ] pieces start (%s) T=%lld: chunk %d's producer steps (us, mean over %lld CTAs): "
                    "load %.2f, gate and row scales %.2f, norms %.2f, scan %.2f, factors %.2f, L / Mqk product "
                    "%.2f, their stores %.2f, hand-over %.2f; sum %.2f\n",
                    mode_name.c_str(), (long long)T, c, (long long)two_chunks, m(0), m(1),
                    m(2), m(3), m(4), m(5), m(6), m(7), m(0) + m(1) + m(2) + m(3) + m(4) + m(5) + m(6) + m(7));
      }
    }
  }
}

}  // namespace
}  // namespace flashkda::cuda::sm90::prefill_v2
