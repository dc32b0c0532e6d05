#!/usr/bin/env bash
# Candidate kernel changes side by side in one device call: for every patch .ab/NAME.patch
# (made with `git diff main...BRANCH > .ab/NAME.patch`; .ab/ is ignored, carry it), copy the
# tree to /tmp/ab/NAME, apply the patch, build the CUDA library, tests and Python extension
# there, run the GPU test binaries, compute-sanitizer memcheck and racecheck on the small cases,
# and the per-kernel profile (again with the KEY=VALUE lines of .ab/NAME.env exported, when that
# file exists). Everything goes to one log, $OUT/ab.log (the device tool returns
# at most 8 files). Run scripts/gpu_check.sh profile in the same call for the baseline.
#
#   scripts/gpu_ab.sh [NAME ...]     (default: every .ab/*.patch)
#   AB_STEPS="test sanitize profile" (default) picks the steps; AB_STEPS=profile times every
#   candidate first (about 2 minutes each: the Python extension build and the profile, its arguments
#   in AB_PROFILE_ARGS, default --quick), so that the tests and sanitizers (about 6 minutes each)
#   run in a later call for the winners only.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
LOG="$OUT/ab.log"
CUTLASS=${CUTLASS_DIR:-$PWD/.deps/cutlass/cutlass_library/source/include}
JOBS=$(nproc)
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  for p in .ab/*.patch; do [ -e "$p" ] && names+=("$(basename "$p" .patch)"); done
fi
[ ${#names[@]} -eq 0 ] && { echo "no .ab/*.patch" | tee -a "$LOG"; exit 1; }
status=0
say() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }
AB_STEPS=${AB_STEPS:-test sanitize profile}
ab_want() { [[ " $AB_STEPS " == *" $1 "* ]]; }

for name in "${names[@]}"; do
  dir=/tmp/ab/$name
  say "$name: apply"
  rm -rf "$dir" && mkdir -p "$dir"
  tar --exclude='./build*' --exclude='./.git' --exclude='./.ab' --exclude='./.peers' --exclude='./.whl' --exclude='./.deps' -cf - . | tar -xf - -C "$dir"
  if ! (cd "$dir" && patch -p1 < "$OLDPWD/.ab/$name.patch" >> "$LOG" 2>&1); then
    echo "$name: the patch does not apply" | tee -a "$LOG"; status=1; continue
  fi
  if ab_want test || ab_want sanitize; then
    say "$name: build"
    if ! (cd "$dir" && cmake -S . -B build -G Ninja -DFLASHKDA_CUDA=ON -DFLASHKDA_BUILD_TESTS=ON -DCUTLASS_DIR="$CUTLASS" > /dev/null &&
          cmake --build build -j "$JOBS" 2>&1 | grep -E "error|warning|spill" >> "$LOG"; [ "${PIPESTATUS[0]}" -eq 0 ]); then
      echo "$name: build failed" | tee -a "$LOG"; status=1; continue
    fi
  fi
  if ab_want profile; then
    say "$name: Python build"
    (cd "$dir" && CMAKE_ARGS="-DFLASHKDA_CUDA=ON -DCUTLASS_DIR=$CUTLASS" CMAKE_BUILD_PARALLEL_LEVEL=$JOBS \
       python3 -m pip install --no-build-isolation --no-deps -q --target "$dir/site" . >> "$LOG" 2>&1) ||
      { echo "$name: Python build failed" | tee -a "$LOG"; status=1; continue; }
  fi
  if ab_want test; then
    say "$name: GPU tests"
    for t in "$dir"/build/tests/cpp/test_*gpu; do
      timeout 600 "$t" --gtest_brief=1 2>&1 | grep -E "measure|FAILED|PASSED|tests ran" | tee -a "$LOG" | grep -E "FAILED" && status=1
    done
  fi
  if ab_want sanitize; then
    say "$name: compute-sanitizer"
    # with the patch's switches when it has them (the riskier path); the tests above ran both ways
    # only where they set the switches themselves
    [ -f ".ab/$name.env" ] && { set -a; . ".ab/$name.env"; set +a; }
    for tool in memcheck racecheck; do
      for bin in test_prefill_gpu test_decode_gpu; do
        filter='*'
        [ $bin = test_prefill_gpu ] && filter='*VarlenWithEmpty*:*GateForms*:*OddLengths*'
        timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 "$dir/build/tests/cpp/$bin" \
          --gtest_filter="$filter" --gtest_brief=1 > /tmp/ab_san.log 2>&1
        rc=$?
        echo "$name $bin $tool: exit $rc $(grep -E 'SUMMARY' /tmp/ab_san.log | head -1)" | tee -a "$LOG"
        [ $rc -ne 0 ] && { status=1; tail -20 /tmp/ab_san.log >> "$LOG"; }
      done
    done
    [ -f ".ab/$name.env" ] && while IFS='=' read -r key _; do [ -n "$key" ] && unset "$key"; done < ".ab/$name.env"
  fi
  ab_want profile || continue
  say "$name: profile"
  # shellcheck disable=SC2086  # AB_PROFILE_ARGS: the profile's arguments (default --quick), split on spaces
  PYTHONPATH="$dir/site:${PYTHONPATH:-}" FLA_FLASH_KDA=0 python3 benchmarks/profile_prefill.py ${AB_PROFILE_ARGS:---quick} 2>&1 |
    grep -v Warn | tee -a "$LOG" | tail -24
  if [ -f ".ab/$name.env" ]; then  # a second profile with the patch's switches (KEY=VALUE lines)
    say "$name: profile with $(tr '\n' ' ' < ".ab/$name.env")"
    (set -a; . ".ab/$name.env"; set +a
     # shellcheck disable=SC2086
     PYTHONPATH="$dir/site:${PYTHONPATH:-}" FLA_FLASH_KDA=0 python3 benchmarks/profile_prefill.py ${AB_PROFILE_ARGS:---quick} 2>&1 |
       grep -v Warn | tee -a "$LOG" | tail -24)
  fi
done
say "done status=$status"
exit $status
