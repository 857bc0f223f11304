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
PREFIX=${KG_PREFIX:-$PWD/.carry/prefix}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16} PYTHONUNBUFFERED=1
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
# The system compiler: a toolchain that links libstdc++ statically into our libraries (as the H200
# machine's /opt/gcc wrapper does) mixes two libstdc++ copies in one process, and iostreams crash.
COMPILERS=()
if [ -x /usr/bin/g++ ]; then
  COMPILERS=(-C cmake.define.CMAKE_C_COMPILER=/usr/bin/gcc -C cmake.define.CMAKE_CXX_COMPILER=/usr/bin/g++
             -C cmake.define.CMAKE_CUDA_HOST_COMPILER=/usr/bin/g++)
fi
python3 -m pip install --no-build-isolation --no-deps --no-index -v -C build-dir=build/h200 "${COMPILERS[@]}" \
  -C cmake.define.CMAKE_PREFIX_PATH="$PREFIX" . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
# See scripts/gpu_check.sh: libstdc++ first, on machines where another copy shadows it.
LIBSTDCXX=/lib/x86_64-linux-gnu/libstdc++.so.6
[ -f "$LIBSTDCXX" ] && export LD_PRELOAD="$LIBSTDCXX${LD_PRELOAD:+:$LD_PRELOAD}"
start=$(date +%s)
kernelgate bench run "$OP" --grid "$GRID" --db "$OUT/evidence.sqlite" --json >"$OUT/sweep.json" 2>"$OUT/sweep.log"
rc=$?
echo "sweep: $(( $(date +%s) - start )) s, rc $rc"; cat "$OUT/sweep.json"
kernelgate policy show "$OP" --db "$OUT/evidence.sqlite" | tee "$OUT/policy.txt"
kernelgate doctor --db "$OUT/evidence.sqlite" | tee "$OUT/doctor.txt"
exit $rc
