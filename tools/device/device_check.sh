#!/usr/bin/env bash
# The GPU run (issue 35) on a lent NVIDIA machine, which reaches no package registry:
# installs the wheels carried in .whl/ (made here by tools/device/device_wheels.py), runs
# the exactness, batch and sync tests on the GPU, then benchmarks/device_bench.py, whose
# table ends the output. Logs and the rows' JSON lines go to $OUT (else a new temp dir).
#
#   bash tools/device/device_check.sh             # on the device, with .whl carried
#   bash tools/device/device_check.sh --dry-run   # here: every step but the GPU's
#   bash tools/device/device_check.sh --cpu       # here: device_bench.py on this CPU, small counts
#
# TESTS_S and BENCH_S bound the two parts in seconds (0 skips one); PY is the Python of
# --dry-run and --cpu (the project's environment), SITE where the device installs.
set -u -o pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$(mktemp -d)}
PY=${PY:-python3}
TESTS=(tests/test_exactness.py tests/test_batch.py tests/test_syncs.py)

case ${1:-} in
--dry-run)
  bash -n "$0" || exit 1
  "$PY" -m pytest -q -p no:cacheprovider --collect-only "${TESTS[@]}" | tail -1 || exit 1
  "$PY" tools/device/device_wheels.py --check || exit 1
  echo "device_check --dry-run: ok"
  exit 0 ;;
--cpu)
  nice -n 19 "$PY" benchmarks/device_bench.py --tokens 8 --runs 1 --rounds 1 --prefill 128 --out "$OUT" \
    2>&1 | tee "$OUT/bench.log"
  exit ;;
"") ;;
*) echo "usage: $0 [--dry-run | --cpu]"; exit 2 ;;
esac

start=$SECONDS
command -v nvidia-smi >/dev/null || { echo "device_check: no NVIDIA GPU here (nvidia-smi not found)"; exit 2; }
ls .whl/*.whl >/dev/null 2>&1 || { echo "device_check: no .whl/ (run tools/device/device_wheels.py, carry .whl)"; exit 2; }
gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)
SITE=${SITE:-/tmp/site}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
  >"$OUT/install.log" 2>&1 || { echo "device_check: installing .whl/ failed"; tail -5 "$OUT/install.log"; exit 1; }
# libmlx.so looks for CUDA's libraries at $ORIGIN/../../nvidia/*/lib: point that at the image's (torch's)
ln -sfn "$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])')" "$SITE/nvidia" || exit 1
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
# mlx compiles some kernels at run time (NVRTC) against CUDA's headers: CUDA_HOME, else /usr/local/cuda
nvcc=$(command -v nvcc) && [ ! -d /usr/local/cuda ] && export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$nvcc")")}

python3 - >"$OUT/smoke.log" 2>&1 <<'EOF'
import mlx.core as mx
print("mlx", mx.__version__, mx.default_device())
assert mx.default_device() == mx.gpu, "mlx is not on the GPU"
w, s, b = mx.quantize(mx.random.normal((256, 512)), 64, 4)
x = mx.random.normal((1, 512))
y = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4)
print("4-bit matmul on the GPU, max |y - ref|:", (y - x @ mx.dequantize(w, s, b, 64, 4).T).abs().max().item())
EOF
smoke=$?
cat "$OUT/smoke.log"
if [ $smoke -ne 0 ]; then
  echo "device_check: mlx does not run on the GPU; libraries libmlx.so does not find:"
  ldd "$SITE/mlx/lib/libmlx.so" | grep "not found"
  exit 1
fi
command -v cuobjdump >/dev/null && echo "kernels in libmlx.so: $(cuobjdump --list-elf "$SITE/mlx/lib/libmlx.so" \
  | sed -E 's/.*\.(sm_[0-9a-z]+)\.cubin/\1/' | sort | uniq -c | xargs)"

tests="skipped"
if [ "${TESTS_S:-150}" -gt 0 ]; then
  t0=$SECONDS
  timeout "${TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider "${TESTS[@]}" >"$OUT/tests.log" 2>&1
  rc=$?
  tests="$(tail -1 "$OUT/tests.log" | cut -c1-100) (exit $rc$([ $rc -eq 124 ] && echo ": timed out"), $((SECONDS - t0)) s)"
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
fi
echo "tests on the GPU: $tests"

[ "${BENCH_S:-270}" -gt 0 ] && timeout "${BENCH_S:-270}" python3 benchmarks/device_bench.py --out "$OUT" 2>&1 \
  | tee "$OUT/bench.log"
echo
echo "device_check on $gpu: $((SECONDS - start)) s; tests: $tests; logs in $OUT" | tee "$OUT/summary.txt"
