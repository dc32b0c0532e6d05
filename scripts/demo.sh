#!/usr/bin/env bash
# Sets up what the Python package needs (pip installs what is missing), builds and installs flashkda,
# and runs the demo: python -m flashkda.demo (arguments are passed on, e.g. --backend cpu).
#
# The CUDA backend is built when a GPU is visible (nvidia-smi) and nvcc + CUTLASS are found;
# otherwise the build is CPU only. Override with FLASHKDA_CUDA=ON|OFF|AUTO.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
log() { echo "demo.sh: $*" >&2; }

missing=()
for mod in numpy:numpy ml_dtypes:ml_dtypes scikit_build_core:scikit-build-core nanobind:nanobind; do
  "$PY" -c "import ${mod%%:*}" 2>/dev/null || missing+=("${mod#*:}")
done
if ! cmake --version 2>/dev/null | awk 'NR==1 { split($3, v, "."); exit !(v[1] > 3 || (v[1] == 3 && v[2] >= 24)) }'; then
  missing+=(cmake)
fi
command -v ninja >/dev/null || "$PY" -c "import ninja" 2>/dev/null || missing+=(ninja)
if ((${#missing[@]})); then
  log "installing ${missing[*]}"
  export PIP_ROOT_USER_ACTION=ignore
  # Offline machines: wheels put in .deps/wheels beforehand (pip download ... -d .deps/wheels) come first.
  if [[ -d .deps/wheels ]] && "$PY" -m pip install --quiet --no-index --find-links .deps/wheels "${missing[@]}" 2>/dev/null; then
    :
  else
    "$PY" -m pip install --quiet "${missing[@]}"
  fi
fi

if [[ -z "${FLASHKDA_CUDA:-}" ]]; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    export FLASHKDA_CUDA=AUTO
  else
    export FLASHKDA_CUDA=OFF  # no GPU here: skip compiling the CUDA kernels
  fi
fi
log "building flashkda (FLASHKDA_CUDA=$FLASHKDA_CUDA; incremental in build-py/)"
export PIP_ROOT_USER_ACTION=ignore
build_log=$(mktemp)
if ! "$PY" -m pip install -v --no-build-isolation ./ >"$build_log" 2>&1; then
  tail -40 "$build_log" >&2
  log "build failed (full log: $build_log)"
  exit 1
fi
rm -f "$build_log"

cd /tmp
exec "$PY" -m flashkda.demo "$@"
