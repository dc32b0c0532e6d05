#!/usr/bin/env bash
# Runs scripts/gpu_check.sh detached from the device call (setsid: it survives the call while the
# machine stays warm), waits up to WAIT seconds for it to finish, and copies its logs (the newest 6
# and all of them as logs.tgz: the device tool returns 8 files) to $OUT. Call it again with the same
# steps to keep waiting: the pipeline is started once per machine. The machine is given back ~30 s
# after a call returns, so issue the next poll at once.
#
#   scripts/gpu_detached.sh WAIT [gpu_check steps...]     e.g. scripts/gpu_detached.sh 560 build test sanitize python
#
# H200_STEPS="..." (optional): the gpu_check steps to run instead where the machine that came is an
# H200 (a call may get either kind), e.g. H200_STEPS="build bench decode profile" with "build test python"
# as the arguments for an H100.
# PRE="..." (optional): a command the pipeline runs first, e.g. PRE="scripts/gpu_prebuilt.sh run
# 'test_decode:DecodeCpuIsas*' 'test_prefill32_gpu:*TimeThePiecesCtaByCta*'" for binaries built here
# (PREBUILT_XZ=1: they travel beside the peers' files), its logs under the same folder. Each poll also
# returns every log of the pipeline as one logs.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
wait_s=${1:-560}
shift || true
dir=/tmp/gpu-detached
mkdir -p "$dir/out"
if [ ! -f "$dir/started" ]; then
  touch "$dir/started"
  # setsid -w: $! is a process that lives as long as the pipeline, whether or not setsid forks
  # shellcheck disable=SC2016  # $OUT and $PRE expand in the detached shell
  OUT="$dir/out" PRE="${PRE:-}" H200_STEPS="${H200_STEPS:-}" setsid -w nohup bash -c '
    [ -z "$PRE" ] || { echo "=== pre: $PRE"; eval "$PRE"; }
    if [ -n "$H200_STEPS" ] && nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
      echo "=== an H200: steps $H200_STEPS"
      set -- $H200_STEPS
    fi
    exec bash scripts/gpu_check.sh "$@"' gpu_detached "$@" > "$dir/console.log" 2>&1 < /dev/null &
  echo $! > "$dir/pid"
  echo "started: scripts/gpu_check.sh $*"
fi
# Stop waiting when the pipeline is done, or gone without its done line (killed, or an early
# exit): waiting out WAIT then would only spend device time.
alive() { [ ! -f "$dir/pid" ] || kill -0 "$(cat "$dir/pid")" 2>/dev/null; }  # no pid file: an older pipeline
end=$((SECONDS + wait_s))
while [ $SECONDS -lt $end ] && ! grep -q "^=== done" "$dir/console.log" 2>/dev/null && alive; do sleep 5; done
mkdir -p "${OUT:-gpu-out}"
cp "$dir/console.log" "${OUT:-gpu-out}/"
ls -t "$dir/out" | head -6 | while read -r f; do cp "$dir/out/$f" "${OUT:-gpu-out}/"; done
tar -C "$dir" -czf "${OUT:-gpu-out}/logs.tgz" out console.log 2> /dev/null
tail -40 "$dir/console.log"
if grep -q "^=== done" "$dir/console.log"; then echo "PIPELINE FINISHED"
elif alive; then echo "still running: call again"
else echo "PIPELINE DIED without its done line (console.log above); rm -rf $dir to start again"; fi
