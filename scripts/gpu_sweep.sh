#!/usr/bin/env bash
# On the GPU machine: build, then full sweeps of the given ops (default: every op), each into its
# own store, packed for shipping: $OUT/shipped.tar holds <gpu>-<op>.sqlite.xz per op
# (scripts/ship_evidence.py), to untar into python/kernelgate/evidence/ and commit with the
# change. Every op's built-in backends are swept before any op's library backends. A sweep cut
# short by KG_SWEEP_DEADLINE (seconds since the script started) keeps what it measured; a later
# call resumes it from the packed stores found in .carry/sweeps/.
#   OUT=... KG_SWEEP_DEADLINE=480 KG_SWEEP_ARGS="--dtype bfloat16" bash scripts/gpu_sweep.sh "linear_cross_entropy swiglu" [GRID]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
OPS=${1:-all}
GRID=${2:-full}
DEADLINE=${KG_SWEEP_DEADLINE:-100000}
T0=$(date +%s)
mkdir -p "$OUT"
source scripts/gpu_env.sh
ARCHS=(); [ -n "${KG_CUDA_ARCHS:-}" ] && ARCHS=(-C "cmake.define.CMAKE_CUDA_ARCHITECTURES=$KG_CUDA_ARCHS")
if [ -z "${KG_NO_BUILD:-}" ]; then
  python3 -m pip install --no-build-isolation --no-deps --no-index -v -C build-dir=build/h200 "${COMPILERS[@]}" \
    "${ARCHS[@]}" -C cmake.define.CMAKE_PREFIX_PATH="$PREFIX" . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
fi
# Carried wheels (e.g. Liger-Kernel) too, for a benchmark run after the sweeps in the same call.
if ls .carry/wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index .carry/wheels/*.whl >"$OUT/wheels.log" 2>&1 || tail -5 "$OUT/wheels.log"
fi
preload_libstdcxx
[ "$OPS" = all ] && OPS=$(python3 -c 'import kernelgate as kg; print(" ".join(o["name"] for o in kg.ops()))')
SW=${KG_SWEEP_DIR:-/tmp/kg_sweeps}
mkdir -p "$SW"
ls .carry/sweeps/*.sqlite.xz >/dev/null 2>&1 && python3 scripts/ship_evidence.py unpack --out "$SW" .carry/sweeps/*.sqlite.xz >/dev/null
rc=0
# Two passes: every op's built-in backends first, then the library backends (whose per-shape
# autotuning can take most of a sweep's time: FLA's causal_conv1d about 20 s a shape), so that a
# deadline leaves the ops' own evidence complete before it spends time on the libraries'.
builtin() { python3 -c 'import sys, kernelgate as kg; o = next(o for o in kg.ops() if o["name"] == sys.argv[1]); print(" ".join("--backend " + b["name"] for b in o["backends"] if b["kind"] != "python"))' "$1"; }
for pass in builtin all; do
  for op in $OPS; do
    left=$(( DEADLINE - ($(date +%s) - T0) ))
    if [ "$left" -le 20 ]; then echo "$op ($pass backends): not started (deadline)"; continue; fi
    db="$SW/h200-$op.sqlite"
    BACKENDS=(); [ "$pass" = builtin ] && read -ra BACKENDS <<<"$(builtin "$op")"
    start=$(date +%s)
    timeout -s INT "$left" kernelgate bench run "$op" --grid "$GRID" ${KG_SWEEP_ARGS:-} "${BACKENDS[@]}" --db "$db" --json \
      >"$SW/sweep_${op}_$pass.json" 2>"$SW/sweep_${op}_$pass.log"
    r=$?
    echo "$op ($pass backends): $(( $(date +%s) - start )) s, rc $r, $(python3 -c "import json,sys; d=json.load(open(sys.argv[1]))[sys.argv[2]]; print(d.get('dispositions'), 'skipped', d.get('skipped'), 'planned', d.get('planned'))" "$SW/sweep_${op}_$pass.json" "$op" 2>/dev/null || tail -2 "$SW/sweep_${op}_$pass.log")"
    [ $r -ne 0 ] && rc=$r
  done
done
python3 scripts/ship_evidence.py pack --gpu h200 --out "$SW/packed" "$SW"/h200-*.sqlite
tar -C "$SW/packed" -cf "$OUT/shipped.tar" .
[ -n "${KG_POLICY:-}" ] && for op in $OPS; do kernelgate policy show "$op" --db "$SW/h200-$op.sqlite"; done >"$SW/policy.txt" 2>&1
tar -C "$SW" -cf "$OUT/sweep_logs.tar" $(cd "$SW" && ls policy.txt sweep_* 2>/dev/null)
exit $rc
