#!/usr/bin/env bash
# The CPU side under AddressSanitizer + UndefinedBehaviorSanitizer (host only, no GPU needed):
# builds the C++ suite and the Python extension (CPU backend) with -fsanitize=address,undefined,
# runs ctest, the argument fuzzer (numpy, and torch CPU when installed) and pytest against that
# extension. Any sanitizer report fails the run (undefined behaviour aborts: no recovery).
#
#   scripts/sanitize_host.sh            FUZZ_CASES (1500) per fuzzer run, SAN_DIR (/tmp/flashkda-san)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
DIR=${SAN_DIR:-/tmp/flashkda-san}
CASES=${FUZZ_CASES:-1500}
FLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"

echo "=== C++ suite (CPU backend) with $FLAGS"
cmake -S . -B "$DIR/cpp" -G Ninja -DFLASHKDA_CUDA=OFF -DFLASHKDA_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS="$FLAGS" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
ninja -C "$DIR/cpp" >/dev/null
(cd "$DIR/cpp" && ctest -j"$(nproc)" --output-on-failure | tail -3)

echo "=== Python extension (CPU backend) with the same flags"
FLASHKDA_CUDA=OFF "$PY" -m pip install -q --no-build-isolation --no-deps --target "$DIR/site" --upgrade \
  -C build-dir="$DIR/py" -C "cmake.define.CMAKE_CXX_FLAGS=$FLAGS" -C cmake.define.CMAKE_BUILD_TYPE=RelWithDebInfo \
  -C "cmake.define.CMAKE_SHARED_LINKER_FLAGS=-fsanitize=address,undefined" .
# The interpreter is not instrumented: the runtimes are preloaded, leak checks are off (CPython's
# own allocations at exit are not ours).
export LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
export ASAN_OPTIONS=detect_leaks=0 PYTHONPATH="$DIR/site${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import flashkda, sys; assert flashkda.__file__.startswith('$DIR/site'), flashkda.__file__"
modes=(numpy)
"$PY" -c "import torch" 2>/dev/null && modes+=(torch)
for mode in "${modes[@]}"; do
  echo "=== fuzzer, $mode, $CASES cases x 2"
  for seed in 11 12; do "$PY" tests/python/fuzz_arguments.py "$seed" "$CASES" "$mode" | tail -2; done
done
echo "=== pytest"
"$PY" -m pytest -q -p no:cacheprovider tests/python | tail -2
