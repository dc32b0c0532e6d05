#!/usr/bin/env bash
# Device calls without a build step, for when little device time is left (a build of one GPU test
# binary takes ~100 s of it): the binaries are built on this machine (nvcc 13.0, as the device's) and
# carried to the device.
#
#   scripts/gpu_prebuilt.sh prepare [TARGET ...]   here: builds the GPU test binaries named (default
#       test_prefill32_gpu) in build-gpu-local/ and copies them, with the fused kernel's object
#       (fused.cu.o, for gpu_check.sh fused-profile's attribution), into .prebuilt/ (ignored: name
#       .prebuilt and .deps in the device call's carry; ~26 MB a test binary).
#       PREBUILT_XZ=1: the binaries packed into one .prebuilt/bins.tar.xz instead (~5 MB for six test
#       binaries: they share the library), so that .deps, .whl and .peers fit the same carry; `run`
#       unpacks it. Any test target builds so, test_decode (CPU) too.
#   scripts/gpu_prebuilt.sh run [TARGET:FILTER ...]  on the device: each binary with its gtest filter
#       (default test_prefill32_gpu:*TimeAtServingShape*), its log under $OUT; a binary that does not
#       load there (other system libraries) is built there first. FUSED_PROFILE=1 then runs
#       gpu_check.sh's fused-profile step on the carried test_prefill32_gpu and object.
#
#   scripts/gpu_prebuilt.sh keep NAME               here: after `prepare`, keeps its test_prefill32_gpu
#       and fused.cu.o as build NAME (.prebuilt/ab/NAME.tar.xz, ~6 MB; prepare clears the others
#       unless AB_KEEP=1), for an A/B of two or more builds of the same kernels on one machine.
#   scripts/gpu_prebuilt.sh ab [ROUNDS] [FILTER]       on the device: each kept build's timing case
#       (default *TimeAtServingShape*), the builds in turn, ROUNDS times (default 2): timings of
#       different builds compare only within one call, on one warm machine. Logs: $OUT/ab_NAME_ROUND.log.
#
# The binaries must come from the tree that travels with the call: `prepare` records the commit and
# whether the tree was clean, and `run` prints both, so a stale binary shows in the log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
CUTLASS=${CUTLASS_DIR:-$PWD/.deps/cutlass/cutlass_library/source/include}
mode=${1:-}
shift || true
case "$mode" in
  prepare)
    targets=("$@")
    [ ${#targets[@]} -eq 0 ] && targets=(test_prefill32_gpu)
    cmake -S . -B build-gpu-local -G Ninja -DFLASHKDA_CUDA=ON -DFLASHKDA_BUILD_TESTS=ON -DFLASHKDA_BUILD_PYTHON=OFF \
      -DCUTLASS_DIR="$CUTLASS" > /dev/null && cmake --build build-gpu-local -j "$(nproc)" --target "${targets[@]}" |
      grep -E "error|warning" || true
    if [ "${AB_KEEP:-0}" = 1 ]; then find .prebuilt -maxdepth 1 -type f -delete 2>/dev/null; else rm -rf .prebuilt; fi
    mkdir -p .prebuilt
    for t in "${targets[@]}"; do cp "build-gpu-local/tests/cpp/$t" .prebuilt/ || exit 1; done
    cp "$(find build-gpu-local -name fused.cu.o | head -1)" .prebuilt/
    if [ "${PREBUILT_XZ:-0}" = 1 ]; then
      tar -C .prebuilt -cf - "${targets[@]}" | xz -T0 -9 --lzma2=dict=128MiB > .prebuilt/bins.tar.xz || exit 1
      (cd .prebuilt && rm -f "${targets[@]}" fused.cu.o)
    fi
    echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (with uncommitted changes)')" > .prebuilt/commit
    ls -la .prebuilt
    ;;
  keep)
    name=${1:?keep NAME}
    mkdir -p .prebuilt/ab && cp .prebuilt/commit ".prebuilt/ab/$name.commit"
    tar -C .prebuilt -cf - test_prefill32_gpu fused.cu.o | xz -T0 -6 > ".prebuilt/ab/$name.tar.xz" && ls -la .prebuilt/ab
    ;;
  ab)
    mkdir -p "$OUT"
    rounds=${1:-2} filter=${2:-*TimeAtServingShape*}
    nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
    names=()
    for f in .prebuilt/ab/*.tar.xz; do
      n=$(basename "$f" .tar.xz) && names+=("$n") && mkdir -p "/tmp/ab/$n" && xz -dc "$f" | tar -C "/tmp/ab/$n" -xf - || exit 1
      echo "build $n: $(cat ".prebuilt/ab/$n.commit" 2>/dev/null)"
    done
    status=0
    for ((i = 1; i <= rounds; ++i)); do
      for n in "${names[@]}"; do
        timeout 300 "/tmp/ab/$n/test_prefill32_gpu" --gtest_brief=1 --gtest_filter="$filter" > "$OUT/ab_${n}_$i.log" 2>&1 || status=1
        echo "== $n round $i"
        grep -E "rule's flags|candidates|FAILED" "$OUT/ab_${n}_$i.log" | cut -c1-400
      done
    done
    exit $status
    ;;
  run)
    mkdir -p "$OUT"
    nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
    echo "prebuilt from $(cat .prebuilt/commit 2>/dev/null || echo '?'); this tree $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    [ -f .prebuilt/bins.tar.xz ] && { xz -dc .prebuilt/bins.tar.xz | tar -C .prebuilt -xf - || exit 1; }
    runs=("$@")
    [ ${#runs[@]} -eq 0 ] && runs=("test_prefill32_gpu:*TimeAtServingShape*")
    status=0
    for r in "${runs[@]}"; do
      t=${r%%:*} filter=${r#*:}
      [ "$filter" = "$r" ] && filter='*'
      bin=.prebuilt/$t
      if ! "$bin" --gtest_list_tests > /dev/null 2> "$OUT/$t.load.err"; then
        echo "$bin does not run here ($(head -1 "$OUT/$t.load.err")): building it"
        # gpu_check.sh's build step: it also builds GoogleTest from .deps, which the device lacks
        BUILD_TARGETS=$t OUT="$OUT" bash scripts/gpu_check.sh build || exit 1
        cp "build-gpu/tests/cpp/$t" "$bin" && cp "$(find build-gpu -name fused.cu.o | head -1)" .prebuilt/
      fi
      timeout 600 "$bin" --gtest_brief=1 --gtest_filter="$filter" > "$OUT/$t.log" 2>&1 || status=1
      grep -E "measure|FAILED|PASSED" "$OUT/$t.log" | cut -c1-800
    done
    if [ "${FUSED_PROFILE:-0}" = 1 ]; then
      FUSED_BIN=.prebuilt/test_prefill32_gpu FUSED_OBJ=.prebuilt/fused.cu.o OUT="$OUT" bash scripts/gpu_check.sh fused-profile
    fi
    exit $status
    ;;
  *) sed -n 2,25p "$0"; exit 2 ;;
esac
