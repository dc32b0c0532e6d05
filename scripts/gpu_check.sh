#!/usr/bin/env bash
# One call on a Hopper GPU machine: build flashkda with the CUDA backend, run every C++ test
# (CPU and GPU), compute-sanitizer on small GPU cases, build + test the Python package, and the
# benchmarks against the peers. Logs and tables go under $OUT (default ./gpu-out).
#
#   scripts/gpu_check.sh [build] [test] [gpu-tests] [python] [bench] [decode] [fused] [pieces] [chain] [pending] [sanitize] [profile] [v2] [decode-profile] [fused-profile] [ab]
#   (the steps run in this order whatever the order given: the benchmarks before the sanitizers)
#   (default: build test sanitize python bench decode; bench = prefill against the peers, both
#   SPEC §7 tables and both gate regimes, CUDA-graph medians, plus accuracy (other arguments in
#   $BENCH_ARGS);
#   gpu-tests = the GPU test binaries only (test runs ctest, which includes them);
#   pending = what docs/VALIDATION.md lists under "Not yet run on the GPU" (its tests, the three sanitizers on
#   them); sanitize = memcheck, racecheck and synccheck on small cases of three suites ($SANITIZE_TOOLS
#   picks fewer tools);
#   v2 = prefill v2's chunk-32 producer and recurrence (test_produce32_gpu, test_prefill32_gpu, then ncu of the producer);
#   decode = the decode benchmark (extra arguments in $DECODE_ARGS); fused = prefill v2's fused
#   kernel against today's kernels across head counts and batches (bench_prefill.py --fused-sweep
#   --fused-batch-sweep, extra arguments in $FUSED_ARGS); pieces = the fused kernel in pieces (a
#   candidate: bench_prefill.py --fused-pieces on the few-head table and H = 96, $PIECES_ARGS); chain = the same
#   chained (--fused-chain, one sequence at many heads, $CHAIN_CASES, $CHAIN_PIECES); decode-profile = ncu of the
#   persistent decode kernel on a bf16 pool beside a device copy of the same bytes; fused-profile = ncu of the
#   unsplit fused chunk-32 kernel at T = 8192 H = 96 with per-instruction source counters; profile = per-kernel times
#   (profile_prefill.py with $PROFILE_ARGS, several runs separated by commas, e.g. "--pieces,--lowrank")
#   and ncu of K1/K2 (PROFILE_NCU=0 skips it, PROFILE_NCU_CASES picks the cases); ab =
#   scripts/gpu_ab.sh, candidate patches in .ab/ built, tested and profiled beside this tree.
#   Each benchmark step fits one 10-minute device call on its own.)
#   a local peer hook installs peers under /tmp/peers, which is put on PYTHONPATH when present.
#
# Every step writes its log under $OUT as it goes, so a call cut off by its time limit still
# returns what finished, in at most 8 files (the device tool returns no more): build.log (GPU,
# CMake, pip, peers), ctest.log, sanitize.log, pytest.log, bench_prefill.log, bench_decode.log,
# profile.log.
#
# Optional inputs, carried next to the repo and never committed: .deps/cutlass (CUTLASS headers
# from the nvidia-cutlass wheel), .deps/googletest (GoogleTest sources, built when the machine has
# none), .whl/*.whl (peer wheels, e.g. fla), .peers/setup.sh (a local hook that builds other
# peers). Missing peers are reported and skipped. scripts/gpu_detached.sh runs this script detached
# from the device call and polls it, for pipelines longer than one call.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build test sanitize python bench decode)
want() { [[ " ${steps[*]} " == *" $1 "* ]]; }
CUTLASS=${CUTLASS_DIR:-$PWD/.deps/cutlass/cutlass_library/source/include}
JOBS=$(nproc)
status=0
step() { echo "=== $* ($(date +%T))"; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv | tee "$OUT/build.log"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
peers_pid=""
if { want bench || want decode; } && [ -x .peers/setup.sh ] && [ ! -d /tmp/peers ]; then
  .peers/setup.sh > /tmp/peers.log 2>&1 &
  peers_pid=$!
fi

if want build; then
  step build
  # The GPU machines have no GoogleTest: build it from sources carried in .deps/googletest (a copy of
  # Debian's /usr/src/googletest) when none is installed.
  if [ ! -f /usr/include/gtest/gtest.h ] && [ ! -f /usr/local/include/gtest/gtest.h ] && [ -d .deps/googletest ]; then
    { cmake -S .deps/googletest -B /tmp/gtest-build -G Ninja -DCMAKE_INSTALL_PREFIX=/usr/local -DBUILD_GMOCK=OFF &&
      cmake --build /tmp/gtest-build -j "$JOBS" && cmake --install /tmp/gtest-build; } >> "$OUT/build.log" 2>&1 ||
      echo "GoogleTest from .deps/googletest failed to build (build.log)"
  fi
  # The Python extension in the same tree where nanobind is there: the python step then stages it
  # beside python/flashkda instead of compiling every kernel a second time through pip (minutes).
  py_ext=OFF
  python3 -c "import nanobind" 2> /dev/null && py_ext=ON
  # BUILD_TARGETS (e.g. "test_prefill32_gpu"): only those targets, without the Python extension: the
  # short call that still fits when little device time is left (pair it with GPU_TESTS and GTEST_FILTER).
  [ -n "${BUILD_TARGETS:-}" ] && py_ext=OFF
  cmake -S . -B build-gpu -G Ninja -DFLASHKDA_CUDA=ON -DFLASHKDA_BUILD_TESTS=ON -DFLASHKDA_BUILD_PYTHON=$py_ext \
    -DCUTLASS_DIR="$CUTLASS" >> "$OUT/build.log" 2>&1 &&
    cmake --build build-gpu -j "$JOBS" ${BUILD_TARGETS:+--target $BUILD_TARGETS} >> "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; step done status=1 build failed; exit 1; }
  grep -E "warning|spill" "$OUT/build.log" | grep -v "^$" | head -20
fi

# Every GPU test binary once, directly (its measured errors and a failure's details go to
# ctest.log; the summary lines to the console). The console filters end in sed, never head: head
# exits after its lines, and the SIGPIPE back up the pipe could cut a binary's log mid-run.
# Each binary under a time limit (a kernel that hangs must cost minutes, not the session); the
# candidates still unrun on a GPU (GPU_ALONE, gtest filters separated by ':') after the rest, each
# filter alone under a shorter one.
# GPU_TESTS: a subset of the binaries by name (e.g. "test_prefill_gpu test_decode_gpu"), where a short
# call must validate one change; default every one. GTEST_FILTER: their tests (default all but GPU_ALONE).
GPU_ALONE=${GPU_ALONE:-'*FusedPieces*:*LowRank*'}
gpu_test_binaries() {
  if [ -n "${GPU_TESTS:-}" ]; then for n in $GPU_TESTS; do echo "build-gpu/tests/cpp/$n"; done
  else compgen -G "build-gpu/tests/cpp/test_*gpu"; fi
}
gpu_binaries() {
  for t in $(gpu_test_binaries); do
    [ -x "$t" ] && { timeout 900 "$t" --gtest_brief=1 --gtest_filter="${GTEST_FILTER:--$GPU_ALONE}" 2>&1 | tee -a "$OUT/ctest.log" |
                       grep -E "measure|FAILED|PASSED|SKIPPED" | sed -n 1,60p
                     [ "${PIPESTATUS[0]}" -eq 0 ] || status=1; }
  done
  local alone f
  IFS=: read -ra alone <<< "$GPU_ALONE"
  for f in "${alone[@]}"; do
    for t in $(gpu_test_binaries); do
      [ -x "$t" ] && { timeout 180 "$t" --gtest_brief=1 --gtest_filter="$f" 2>&1 | tee -a "$OUT/ctest.log" |
                         grep -E "measure|FAILED|PASSED|SKIPPED|tests ran" | sed -n 1,30p
                       [ "${PIPESTATUS[0]}" -eq 0 ] || { status=1; echo "$t ($f): failed or timed out"; }; }
    done
  done
}

if want test; then
  step ctest
  ctest --test-dir build-gpu --output-on-failure -j 4 --timeout 900 > "$OUT/ctest.log" 2>&1 || status=1
  grep -E "tests passed|tests failed|Failed|\*\*\*|measure" "$OUT/ctest.log" | head -60
  gpu_binaries
fi

if want gpu-tests && ! want test; then  # the GPU test binaries only (test runs them too)
  step gpu-tests
  gpu_binaries
fi

# compute-sanitizer on one test binary: the summary into sanitize.log, a failure's tail to the console.
san_log="$OUT/sanitize.log"
if want pending || want sanitize; then : > "$san_log"; fi
sanitize() {  # name, tool, command...
  local name=$1 tool=$2 tmp=/tmp/sanitize_$1_$2.log
  shift 2
  # A time limit: a kernel that deadlocks must cost minutes, not the session's device time.
  timeout "${SANITIZE_TIMEOUT:-300}" compute-sanitizer --tool "$tool" --error-exitcode 9 "$@" > "$tmp" 2>&1
  local rc=$?
  { echo "=== $name $tool (exit $rc)"; grep -E "SUMMARY|PASSED|FAILED|tests ran" "$tmp"
    # On failure: the first report in full (what and where), then the tail.
    [ $rc -ne 0 ] && { grep -m1 -A24 -E "^========= (Invalid|Error|Race|Barrier|Uninitialized|Program hit)" "$tmp"; echo ...; tail -20 "$tmp"; }
  } >> "$san_log"
  if [ $rc -eq 0 ]; then echo "$name $tool: clean"; else echo "$name $tool: FAILED"; status=1; tail -20 "$tmp"; fi
}

if want python || want bench || want profile || want decode || want fused || want pieces || want chain || want decode-profile; then
  step python-build
  # Only an extension this call's build step made (py_ext: an older one in build-gpu may predate the tree)
  ext=$([ "${py_ext:-OFF}" = ON ] && compgen -G "build-gpu/python/_C*.so" | head -1)
  if [ -n "$ext" ]; then  # the build step's extension: the package staged on PYTHONPATH, nothing compiled
    rm -rf /tmp/pyflashkda && mkdir -p /tmp/pyflashkda && cp -r python/flashkda /tmp/pyflashkda/ &&
      cp "$ext" /tmp/pyflashkda/flashkda/ && export PYTHONPATH=/tmp/pyflashkda${PYTHONPATH:+:$PYTHONPATH} &&
      echo "flashkda from $ext (staged in /tmp/pyflashkda)" || status=1
  else
    CMAKE_ARGS="-DFLASHKDA_CUDA=ON -DCUTLASS_DIR=$CUTLASS" CMAKE_BUILD_PARALLEL_LEVEL=$JOBS \
      python3 -m pip install --no-build-isolation --no-deps -q . >> "$OUT/build.log" 2>&1 || { status=1; tail -30 "$OUT/build.log"; }
  fi
  if [ -n "$peers_pid" ]; then
    wait "$peers_pid" || { echo "peer setup failed"; tail -20 /tmp/peers.log; }
    { echo "=== peers"; tail -20 /tmp/peers.log; } >> "$OUT/build.log"
  fi
  [ -d /tmp/peers ] && export PYTHONPATH=/tmp/peers:${PYTHONPATH:-}
fi

if want python; then
  step pytest
  python3 -m pytest -q tests/python -rs > "$OUT/pytest.log" 2>&1 || status=1
  tail -15 "$OUT/pytest.log"
fi

export FLA_FLASH_KDA=0 PYTHONUNBUFFERED=1
if want bench; then
  step bench
  # shellcheck disable=SC2086  # BENCH_ARGS: the benchmark's arguments (default --serving), split on spaces
  python3 benchmarks/bench_prefill.py ${BENCH_ARGS:---serving} --out "$OUT/bench_prefill.md" 2>&1 |
    tee "$OUT/bench_prefill.log" | tail -45 || status=1
fi
if want decode; then
  step bench-decode
  # shellcheck disable=SC2086  # DECODE_ARGS: extra arguments, split on spaces
  python3 benchmarks/bench_decode.py ${DECODE_ARGS:-} 2>&1 | tee "$OUT/bench_decode.log" | tail -40 || status=1
fi
if want fused; then
  step fused-sweep
  # shellcheck disable=SC2086  # $FUSED_ARGS: extra arguments, e.g. --fused-floor 128
  python3 benchmarks/bench_prefill.py --fused-sweep --fused-batch-sweep --fused-order --table none --no-accuracy --no-peers ${FUSED_ARGS:-} 2>&1 |
    tee "$OUT/bench_fused.log" | tail -25 || status=1
fi
if want pieces; then  # the fused kernel in pieces (a candidate), both gate regimes; $PIECES_ARGS: extra arguments
  step pieces
  for table in "--table few --fused-pieces 4 8 11" "--table many --cases H=96 --fused-pieces 3 4"; do
    # shellcheck disable=SC2086
    timeout 420 python3 benchmarks/bench_prefill.py $table --no-peers --no-serial --no-balanced --no-fast --no-accuracy --reps 10 \
      ${PIECES_ARGS:-} 2>&1 | tee -a "$OUT/bench_pieces.log" | tail -30 || status=1
  done
fi
if want chain; then  # the fused kernel in chained pieces (a candidate): piece counts on one sequence at many heads,
  # both gate regimes, beside the unchained pieces; $CHAIN_CASES (bench --cases), $CHAIN_PIECES
  step chain
  # shellcheck disable=SC2086
  timeout 480 python3 benchmarks/bench_prefill.py --table many --cases "${CHAIN_CASES:-one seq}" --fused-pieces 4 \
    --fused-chain ${CHAIN_PIECES:-2 3 4 6 8 11} --no-peers --no-serial --no-balanced --no-fast --no-accuracy --reps 10 2>&1 |
    tee "$OUT/bench_chain.log" | tail -40 || status=1
fi
if want profile; then
  step profile
  IFS=, read -r -a profile_runs <<< "${PROFILE_ARGS:-}"
  [ ${#profile_runs[@]} -gt 0 ] || profile_runs=("")
  for args in "${profile_runs[@]}"; do
    # shellcheck disable=SC2086  # one run's arguments, split on spaces
    python3 benchmarks/profile_prefill.py $args 2>&1 | tee -a "$OUT/profile.log" | grep -v Warn | tail -30
  done
  if command -v ncu > /dev/null && [ "${PROFILE_NCU:-1}" != 0 ]; then  # PROFILE_NCU=0 skips it
    # PROFILE_NCU_CASES: bench_prefill cases as TABLE:INDEX (default MANY:1, T=8192 H=96), fp32
    # state, the first call's kernels matching PROFILE_NCU_KERNELS (default K1 and K2, the segmented
    # and three-CTA ones included; e.g. "segment_chain_kernel|segment_combine_kernel") with gates of
    # PROFILE_NCU_REGIME (random or long, bench_prefill's regimes; default random).
    for c in ${PROFILE_NCU_CASES:-MANY:1}; do
      ncu --clock-control none -k regex:"${PROFILE_NCU_KERNELS:-prepare_kernel|recur_kernel|recur_seg3_kernel}" -c 3 \
        --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
        --section InstructionStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        --section LaunchStats --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio" \
        python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import torch
import bench_prefill as b
_, H, lens, st = getattr(b, '${c%%:*}')[${c##*:}]
fn = b.run_flashkda(b.make_inputs(H, lens, st, regime='${PROFILE_NCU_REGIME:-random}'), st)[0]; fn(); torch.cuda.synchronize()" \
        >> "$OUT/profile.log" 2>&1 || echo "ncu case $c failed (see profile.log)"
    done
  fi
fi
# The sanitizers last: the benchmarks' figures first where a call's time runs out.
if want pending; then  # keep in step with docs/VALIDATION.md "Not yet run on the GPU"
  step pending
  # the few-head pieces under the sanitizers: by rule (T = 2048 H = 4, B = 1 and 2, random gates and one
  # long-memory channel); four pieces
  # through a pool (B = 3 T = 640 H = 4, both gate regimes); the rule's flags' small case
  pending_tests=(test_prefill32_gpu '*RuleRunsFewHeadPieces*:*RandomInputsOddLengthWithStates*:*FusedPiecesThroughAPool*')  # pairs: binary, gtest filter
  for ((i = 0; i < ${#pending_tests[@]}; i += 2)); do
    t=build-gpu/tests/cpp/${pending_tests[i]} f=${pending_tests[i + 1]}
    timeout 120 "$t" --gtest_filter="$f" 2>&1 | tee -a "$OUT/ctest.log" | grep -E "measure|Failure|FAILED|PASSED" | sed -n 1,60p
    [ "${PIPESTATUS[0]}" -eq 0 ] || { status=1; echo "${pending_tests[i]} failed or timed out: sanitizers skipped"; continue; }
    for tool in memcheck racecheck synccheck; do
      # racecheck and synccheck: not the conditional graph node's test (under both its graph replay
      # fails with 719, launch failure, where it passes alone and under memcheck: run 135; unexplained,
      # the node is a candidate, off by default)
      [ $tool = memcheck ] || f=${f//:\*PiecesGraphRunsTheKernelsAfterThem\*/}
      sanitize "pending_${pending_tests[i]}" $tool "$t" --gtest_filter="$f"
    done
  done
fi

if want sanitize; then
  step compute-sanitizer
  san=(--gtest_filter='*VarlenWithEmptySequencesInt32*:*SegmentsSmall*:GateFormsAndFlags:*SkipTransitions*')
  # SANITIZE_TOOLS: a subset (e.g. synccheck alone, ~3 of the set's ~10 minutes) where the rest ran clean already
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
    sanitize prefill "$tool" build-gpu/tests/cpp/test_prefill_gpu "${san[@]}"
    [ -x build-gpu/tests/cpp/test_decode_gpu ] && sanitize decode "$tool" build-gpu/tests/cpp/test_decode_gpu
    [ -x build-gpu/tests/cpp/test_serving_prefill_gpu ] && sanitize serving "$tool" \
      build-gpu/tests/cpp/test_serving_prefill_gpu --gtest_filter='*PoolMatches*:*WrongCheckpoint*:*FusedCheckpoints/0'
  done
fi

if want v2; then  # prefill v2's standalone chunk-32 producer: its checks and time, then ncu's counts
  step v2
  for t in test_produce32_gpu test_prefill32_gpu; do
    timeout 300 build-gpu/tests/cpp/$t 2>&1 | tee -a "$OUT/ctest.log" | grep -E "measure|Failure|FAILED|PASSED|rror" | sed -n 1,60p
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
  if command -v ncu > /dev/null; then
    : > "$OUT/profile.log"
    # The timing test's launches: 1 check, 20 writing the records, 20 not: profile the first of each kind.
    for skip in 0 21; do
      echo "=== produce_kernel, launch-skip $skip ($([ $skip -eq 0 ] && echo writing || echo not writing) the records)" | tee -a "$OUT/profile.log"
      ncu --clock-control none -k regex:produce_kernel --launch-skip $skip -c 1 --section SpeedOfLight --section Occupancy \
        --section SchedulerStats --section WarpStateStats --section InstructionStats --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis --metrics smsp__inst_executed.sum,sm__cycles_elapsed.avg,smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed_op_shared_st.sum \
        --print-details all build-gpu/tests/cpp/test_produce32_gpu --gtest_filter='*TimeAtServingShape' > /tmp/ncu_v2.log 2>&1 ||
        echo "ncu failed (profile.log)"
      cat /tmp/ncu_v2.log >> "$OUT/profile.log"
      grep -E "inst_executed|Duration|Registers|Achieved Occupancy|Issue Slots|Executed Ipc|Memory Throughput|DRAM Through|Theoretical Occ|Block Limit|Stall (Long|Barrier|Wait|Short|Math|MIO)" /tmp/ncu_v2.log | sed -n 1,40p
    done
  fi
fi
# ncu's per-instruction source page of a profiled kernel (report $1) as CSV into $OUT/$2, for reading the
# hot spots against the SASS and its line info (-lineinfo) on a machine without ncu.
ncu_source_csv() {
  ncu -i "$1" --page source --csv --print-source sass > "$OUT/$2" 2> /tmp/ncu_source.err ||
    { echo "ncu source page of $1 failed:"; head -5 /tmp/ncu_source.err; }
}
if want decode-profile; then  # issue 13: why bf16 pools move 73-78% of the copy rate (ncu of the
  # persistent decode kernel at N = 256, H = 32, T = 1 and 4, bf16 pool, beside a device copy of the
  # same bytes), with the per-instruction source counters of both decode cases (decode_source_t*.csv)
  step decode-profile
  if command -v ncu > /dev/null; then
    : > "$OUT/profile.log"
    sections="--section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
      --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section LaunchStats \
      --section InstructionStats --section SourceCounters \
      --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_write.sum,smsp__inst_executed.sum"
    for T in 1 4; do
      # shellcheck disable=SC2086
      ncu --clock-control none -k regex:"decode_persistent_kernel" --launch-skip 1 -c 1 $sections --print-details all \
        --import-source yes -f -o /tmp/ncu_decode_t$T \
        python3 benchmarks/bench_decode.py --H 32 --N 256 --T $T --state bf16 --no-fla --no-check --inner 1 --outer 1 \
        --eager-reps 1 > /tmp/ncu_decode_t$T.log 2>&1 || echo "ncu (decode T=$T) failed (profile.log)"
      ncu -i /tmp/ncu_decode_t$T.ncu-rep --print-details all >> /tmp/ncu_decode_t$T.log 2>&1
      ncu_source_csv /tmp/ncu_decode_t$T.ncu-rep decode_source_t$T.csv
    done
    # (a device-to-device copy_ is a memcpy, which ncu does not profile: an elementwise multiply
    # reads and writes the same bytes in one kernel)
    # shellcheck disable=SC2086
    ncu --clock-control none --kernel-name-base demangled -k regex:"MulFunctor" -c 1 $sections --print-details all \
      python3 -c "import torch; a = torch.ones(256 * 32 * 128 * 128, dtype=torch.bfloat16, device='cuda')
b = torch.empty_like(a); torch.mul(a, 2, out=b); torch.cuda.synchronize()" > /tmp/ncu_copy.log 2>&1 ||
      echo "ncu (copy) failed (profile.log)"
    for f in /tmp/ncu_decode_t1.log /tmp/ncu_decode_t4.log /tmp/ncu_copy.log; do
      echo "=== $f" | tee -a "$OUT/profile.log"; cat "$f" >> "$OUT/profile.log"
      grep -E "Duration|DRAM Throughput|dram__bytes|inst_executed.sum |Registers Per|Achieved Occupancy|Issue Slots|Stall (Long|Barrier|Wait|Short|MIO|LG)|Mem Busy" "$f" | sed -n 1,24p
    done
  fi
fi
if want fused-profile; then  # issues 11 / 12: where the fused chunk-32 kernel's cycles go, by instruction (ncu of
  # the unsplit fused kernel with the rule's flags (lower-bound bf16 gates, staged inputs, setmaxnreg, inverting
  # consumers) in test_prefill32_gpu's timing case: T = 8192, H = 96, one sequence, fp32 state, random gates; its
  # first launch, the bit check's). The per-instruction source counters in fused_source.csv, attributed to the
  # producer's and consumers' phases by sass_census.py in fused_census.md, ncu's summary in profile_fused.log,
  # the build's object in fused.cu.o (for reading the samples again elsewhere). Needs only test_prefill32_gpu
  # (FUSED_BIN and FUSED_OBJ name a binary and its fused.cu.o built elsewhere: scripts/gpu_prebuilt.sh).
  step fused-profile
  if command -v ncu > /dev/null; then
    rule=fused_kernelILNS_8GateFormE0ELb0ELb1ELb0ELb1ELb1ELb0ELb0EE  # <lower bound, bf16 gate, staged, no clocks, regsplit, cinv>
    ncu --clock-control none --kernel-name-base mangled -k regex:"$rule" -c 1 --section SpeedOfLight --section Occupancy \
      --section SchedulerStats --section WarpStateStats --section InstructionStats --section SourceCounters \
      --section MemoryWorkloadAnalysis_Tables --metrics smsp__inst_executed.sum,sm__cycles_elapsed.avg --import-source yes \
      -f -o /tmp/ncu_fused "${FUSED_BIN:-build-gpu/tests/cpp/test_prefill32_gpu}" --gtest_filter='*TimeAtServingShape' \
      > "$OUT/profile_fused.log" 2>&1 || echo "ncu (fused) failed (profile_fused.log)"
    ncu -i /tmp/ncu_fused.ncu-rep --print-details all >> "$OUT/profile_fused.log" 2>&1
    ncu_source_csv /tmp/ncu_fused.ncu-rep fused_source.csv
    kernel=$(ncu -i /tmp/ncu_fused.ncu-rep --page details --print-kernel-base mangled 2>/dev/null |
      grep -o '_ZN[A-Za-z0-9_]*fused_kernel[A-Za-z0-9_]*' | head -1)
    obj=${FUSED_OBJ:-$(find build-gpu -name fused.cu.o | head -1)}
    { head -c 3000 "$OUT/fused_source.csv"; echo; echo "kernel $kernel, object $obj"
      PATH=$PATH:/usr/local/cuda/bin python3 scripts/sass_census.py "$obj" "$kernel" --samples "$OUT/fused_source.csv" --most 70 2>&1; } \
      > "$OUT/fused_census.md" || echo "census failed (fused_census.md)"
    cp "$obj" "$OUT/fused.cu.o" 2>/dev/null
    grep -E "Duration|inst_executed.sum |Registers Per|Achieved Occupancy|Issue Slots|Stall (Long|Barrier|Wait|Short|MIO|LG|GMMA)" \
      "$OUT/profile_fused.log" | sed -n 1,24p
  fi
fi
if want ab; then
  step ab
  bash scripts/gpu_ab.sh || status=1
fi
step done status=$status
exit $status
