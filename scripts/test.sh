#!/usr/bin/env bash
# The whole test suite in one call: builds the C++ library with its GoogleTest suite and runs ctest,
# installs the library and builds a find_package(flashkda) consumer against it (tests/install),
# builds and installs the Python package and runs pytest. Missing Python tools (and CMake >= 3.24,
# Ninja) are pip-installed; a missing C++ compiler or GoogleTest is apt-installed when run as root.
#
#   scripts/test.sh                     CUDA backend compiled when nvcc + CUTLASS are found
#   FLASHKDA_CUDA=ON scripts/test.sh    demand it (CI: compiles the sm_90a kernels without a GPU;
#                                       the GPU tests then skip and say why)
#   FLASHKDA_CUDA=OFF scripts/test.sh   CPU backend only
#
# Environment: PYTHON (python3), BUILD_DIR (build), JOBS (nproc), CUTLASS_DIR (CUTLASS headers),
# FLASHKDA_PY_CUDA (the Python package's build; default FLASHKDA_CUDA when set, else AUTO when a GPU
# is visible and OFF otherwise, as scripts/demo.sh does).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
BUILD=${BUILD_DIR:-build}
[[ "$BUILD" = /* ]] || BUILD="$PWD/$BUILD"  # absolute: the consumer build finds the install by it
JOBS=${JOBS:-$(nproc)}
CXX_CUDA=${FLASHKDA_CUDA:-AUTO}
if [[ -n "${FLASHKDA_PY_CUDA:-}" ]]; then
  PY_CUDA=$FLASHKDA_PY_CUDA
elif [[ -n "${FLASHKDA_CUDA:-}" ]]; then
  PY_CUDA=$FLASHKDA_CUDA
elif command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  PY_CUDA=AUTO
else
  PY_CUDA=OFF  # no GPU here: skip compiling the CUDA kernels a second time
fi
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
# Tools pip installs (cmake, ninja) land in this Python's scripts folder.
PATH="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
LOGS=$BUILD/logs
mkdir -p "$LOGS"
log() { echo "test.sh: $*" >&2; }
step() { echo "=== $* ($(date +%T))"; }
# Runs a command with its output in a log file; on failure prints the log's tail and stops.
quiet() {
  local name=$1
  shift
  if ! "$@" >"$LOGS/$name.log" 2>&1; then
    tail -60 "$LOGS/$name.log" >&2
    log "$name failed (full log: $LOGS/$name.log)"
    exit 1
  fi
}

step setup
missing=()
for mod in numpy:numpy ml_dtypes:ml_dtypes scikit_build_core:scikit-build-core nanobind:nanobind pytest:pytest; do
  "$PY" -c "import ${mod%%:*}" 2>/dev/null || missing+=("${mod#*:}")
done
if ! cmake --version 2>/dev/null | awk 'NR==1 { split($3, v, "."); exit !(v[1] > 3 || (v[1] == 3 && v[2] >= 24)) }'; then
  missing+=(cmake)
fi
command -v ninja >/dev/null || missing+=(ninja)
if ((${#missing[@]})); then
  log "pip installing ${missing[*]}"
  quiet pip "$PY" -m pip install "${missing[@]}"
  hash -r
fi
apt_missing=()
command -v g++ >/dev/null || command -v c++ >/dev/null || apt_missing+=(g++)
[[ -f /usr/include/gtest/gtest.h || -f /usr/local/include/gtest/gtest.h ]] || apt_missing+=(libgtest-dev)
if ((${#apt_missing[@]})); then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    log "apt-get installing ${apt_missing[*]}"
    quiet apt env DEBIAN_FRONTEND=noninteractive sh -c \
      "apt-get update && apt-get install -y --no-install-recommends ${apt_missing[*]}"
  else
    log "not found: ${apt_missing[*]} (Debian/Ubuntu: apt-get install ${apt_missing[*]}); trying anyway"
  fi
fi
echo "python: $("$PY" --version 2>&1) ($(command -v "$PY")); $(cmake --version | head -1); C++ build FLASHKDA_CUDA=$CXX_CUDA, Python build FLASHKDA_CUDA=$PY_CUDA"

step "C++ build ($BUILD)"
quiet configure cmake -S . -B "$BUILD" -G Ninja -DFLASHKDA_CUDA="$CXX_CUDA" -DFLASHKDA_BUILD_TESTS=ON
grep -E "^-- flashkda:" "$LOGS/configure.log" || true
quiet build cmake --build "$BUILD" -j "$JOBS"

status=0
step ctest
ctest --test-dir "$BUILD" --output-on-failure -j "$JOBS" 2>&1 | tee "$LOGS/ctest.log" |
  grep -vE "^ *Start |Test +#[0-9]+: .*(Passed|\*\*\*Skipped)" || true
ctest_line=$(grep -E "tests passed" "$LOGS/ctest.log" | tail -1)
[[ "$ctest_line" == "100% tests passed"* ]] || status=1
# GTEST_SKIP reasons (ctest lists skipped tests but not why): each distinct one with its count.
skipped=$(grep -cE "Test +#[0-9]+: .*\*\*\*Skipped" "$LOGS/ctest.log" || true)
if ((skipped > 0)); then
  ctest_line="$ctest_line ($skipped of them skipped)"
  echo "skip reasons:"
  grep -A1 -E ": Skipped$" "$BUILD/Testing/Temporary/LastTest.log" | grep -vE ": Skipped$|^--$" | sort | uniq -c
fi

step "install + find_package consumer (tests/install)"
rm -rf "$BUILD/install" "$BUILD/consumer"
quiet install cmake --install "$BUILD" --prefix "$BUILD/install"
quiet consumer-configure cmake -S tests/install -B "$BUILD/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$BUILD/install"
quiet consumer-build cmake --build "$BUILD/consumer"
if "$BUILD/consumer/consumer" 2>&1 | tee "$LOGS/consumer.log"; then
  consumer_line="consumer: passed"
else
  consumer_line="consumer: FAILED"
  status=1
fi

step "Python package (FLASHKDA_CUDA=$PY_CUDA)"
FLASHKDA_CUDA=$PY_CUDA CMAKE_BUILD_PARALLEL_LEVEL=$JOBS quiet pip-install "$PY" -m pip install -v --no-build-isolation --no-deps .
"$PY" -c "import flashkda; print('flashkda', flashkda.version(), 'built_with_cuda', flashkda.built_with_cuda, 'cuda_available', flashkda.cuda_available())"

step pytest
# Run from the repository root: tests/python imports the installed package (python/ is not on sys.path).
set +e
"$PY" -m pytest tests/python -q -ra 2>&1 | tee "$LOGS/pytest.log"
pytest_rc=${PIPESTATUS[0]}
set -e
((pytest_rc == 0)) || status=1  # 5 (nothing collected) counts as a failure too
pytest_line=$(grep -E "(passed|failed|error|no tests ran)" "$LOGS/pytest.log" | tail -1)

step "summary (status=$status)"
echo "ctest:  ${ctest_line:-no ctest summary (see $LOGS/ctest.log)}"
echo "$consumer_line"
echo "pytest: ${pytest_line:-no pytest summary (see $LOGS/pytest.log)}"
exit $status
