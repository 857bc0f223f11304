#!/usr/bin/env bash
# On the GPU machine: build, then the full rms_norm sweep into $OUT/evidence.sqlite, with the
# policy it gives and the sweep report. The store is what ships as
# python/kernelgate/evidence/<gpu>.sqlite (copy it there and commit it with the closing note).
#   OUT=... bash scripts/gpu_sweep.sh [OP] [GRID]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
OP=${1:-rms_norm}
GRID=${2:-full}
mkdir -p "$OUT"
source scripts/gpu_env.sh
python3 -m pip install --no-build-isolation --no-deps --no-index -v -C build-dir=build/h200 "${COMPILERS[@]}" \
  -C cmake.define.CMAKE_PREFIX_PATH="$PREFIX" . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
preload_libstdcxx
start=$(date +%s)
kernelgate bench run "$OP" --grid "$GRID" --db "$OUT/evidence.sqlite" --json >"$OUT/sweep.json" 2>"$OUT/sweep.log"
rc=$?
echo "sweep: $(( $(date +%s) - start )) s, rc $rc"; cat "$OUT/sweep.json"
kernelgate policy show "$OP" --db "$OUT/evidence.sqlite" | tee "$OUT/policy.txt"
kernelgate doctor --db "$OUT/evidence.sqlite" | tee "$OUT/doctor.txt"
exit $rc
