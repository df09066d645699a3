#!/usr/bin/env bash
# The GPU checks on a machine with an NVIDIA GPU, in under 10 minutes: installs mlx's CUDA
# build in a venv beside the project, runs the exactness tests (decode, batches, syncs)
# on the GPU, then the speculation and batching benchmarks, and prints one table.
#
#   bash benchmarks/device_check.sh            # from anywhere; VENV=.venv-cuda by default
#   WHEELS=/path/to/wheels bash benchmarks/device_check.sh   # offline: pip --no-index --find-links
set -u
cd "$(dirname "$0")/.."
command -v nvidia-smi >/dev/null || { echo "device_check: no NVIDIA GPU here (nvidia-smi not found)"; exit 2; }
VENV=${VENV:-.venv-cuda}
LOGS=${LOGS:-$(mktemp -d)}
PIP_FROM=()
[ -n "${WHEELS:-}" ] && PIP_FROM=(--no-index --find-links "$WHEELS")

start=$SECONDS
python3 -m venv "$VENV" || exit 1
"$VENV/bin/pip" install -q "${PIP_FROM[@]}" -e '.[test]' 'mlx[cuda]' >"$LOGS/install.log" 2>&1 \
  || { echo "device_check: installing mlx[cuda] failed (see $LOGS/install.log)"; tail -3 "$LOGS/install.log"; exit 1; }
PY="$VENV/bin/python"
device=$("$PY" -c 'import mlx.core as mx; print(mx.default_device(), mx.__version__)') \
  || { echo "device_check: mlx does not import"; exit 1; }
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)

rows=()
run() {  # run NAME SECONDS CMD...: one table row from the command's status and last summary line
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$? status=ok
  [ $rc -eq 124 ] && status=timeout
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && status="failed ($rc)"
  rows+=("$(printf '%-22s %-12s %5ss  %s' "$name" "$status" $((SECONDS - t0)) "$(grep -v '^\s*$' "$LOGS/$name.log" | tail -1 | cut -c1-90)")")
}

run exactness 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_exactness.py tests/test_batch.py tests/test_syncs.py
run speculation-demo 90 "$PY" benchmarks/spec_bench.py --demo --tokens 32 --fractions 0.25,1.0 --ngram-k 0,3,auto
run syncs-speculation 60 "$PY" benchmarks/batch_bench.py --speculation --tokens 32
run batching 180 "$PY" benchmarks/batch_bench.py --tokens 32 --batches 1,2,4,8 --rounds 1

echo
echo "device_check on $gpu, mlx $device, $((SECONDS - start)) s; full output in $LOGS"
printf '%-22s %-12s %6s  %s\n' check status time "last line"
printf '%s\n' "${rows[@]}"
for name in speculation-demo syncs-speculation batching; do
  echo; echo "== $name"; grep -E '^ *[0-9]+%|^[0-9]+ |^ *resident|^B ' "$LOGS/$name.log"
done
