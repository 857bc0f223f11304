#!/usr/bin/env bash
# On a GPU of the shipped evidence's architecture other than the one it was swept on (an H100 for
# our H200 sweeps; docs/evidence.md, "Shipped evidence of a second GPU model"): build, then
# `kernelgate rerank` every op with shipped evidence, each into its own store, and pack the stores
# as $OUT/shipped_<gpu>.tar (<gpu>-<op>.sqlite.xz: untar into python/kernelgate/evidence/ and
# commit with the change); then, with them installed in the package as a user gets them, the step
# benchmarks as installed (bench_train_step.py, bench_hybrid_step.py) in what is left of the call.
# A rerank cut short by KG_RERANK_DEADLINE (seconds since the script started) keeps what it timed.
#   OUT=... bash scripts/gpu_rerank_ship.sh [OPS]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( ${KG_CALL_S:-570} - $(el) )); }
mkdir -p "$OUT"
KG_CUDA_ARCHS=${KG_CUDA_ARCHS:-90a-real} KG_STEPS=build bash scripts/gpu_check.sh >"$OUT/build_check.log" 2>&1 \
  || { tail -20 "$OUT/build_check.log"; exit 1; }
echo "build: $(el) s"
source scripts/gpu_env.sh
preload_libstdcxx
# h100 for "NVIDIA H100 80GB HBM3": the name's first word after NVIDIA, lower case
GPU=$(python3 -c 'import torch; print(torch.cuda.get_device_name().replace("NVIDIA ", "").split()[0].lower())')
[ "$GPU" = h200 ] && { echo "this is the GPU the shipped evidence was swept on: nothing to rerank"; exit 1; }
OPS=${1:-$(python3 -c 'import os, kernelgate as kg; print(" ".join(sorted({os.path.basename(p).split("-")[1].split(".")[0] for p in kg.evidence.shipped_paths() if os.path.basename(p).startswith("h200-")})))')}
SW=/tmp/kg_rerank && rm -rf "$SW" && mkdir -p "$SW"
DEADLINE=${KG_RERANK_DEADLINE:-$(( ${KG_CALL_S:-570} - 130 ))}
for op in $OPS; do
  t=$(( DEADLINE - $(el) ))
  [ "$t" -gt 15 ] || { echo "$op: not started (deadline)"; continue; }
  s=$(date +%s)
  timeout -s INT "$t" kernelgate rerank "$op" --db "$SW/$GPU-$op.sqlite" --json >"$SW/rerank_$op.json" 2>"$SW/rerank_$op.log"
  echo "$op: rc $? $(( $(date +%s) - s )) s $(python3 -c "import json,sys; d=json.load(open(sys.argv[1]))[sys.argv[2]]; print(d.get('dispositions'), 'planned', d.get('planned'))" "$SW/rerank_$op.json" "$op" 2>/dev/null || tail -1 "$SW/rerank_$op.log")"
done
python3 scripts/ship_evidence.py pack --gpu "$GPU" --out "$SW/packed" "$SW/$GPU"-*.sqlite
tar -C "$SW/packed" -cf "$OUT/shipped_$GPU.tar" .
tar -C "$SW" -cf "$OUT/rerank_logs.tar" $(cd "$SW" && ls rerank_*)
# As a user installs them: in the package's evidence directory, no user store.
cp "$SW/packed"/*.sqlite.xz "$(python3 -c 'import kernelgate, os; print(os.path.dirname(kernelgate.__file__))')/evidence/"
export KERNELGATE_DB=/tmp/kg_empty_user.sqlite && rm -f "$KERNELGATE_DB"
kernelgate doctor 2>&1 | grep -i "evidence\|policy" | head -5
cd bench
run() { local cap=$1; shift; local t=$(( $(left) < cap ? $(left) : cap )); [ "$t" -gt 30 ] || { echo "not run: $*"; return; }
        timeout "$t" "$@" 2>&1 | tail -7; echo "$(el) s"; }
run 120 python3 bench_train_step.py --variants ${KG_STEP_VARIANTS:-eager,kernelgate,liger,compile} --out "$OUT/train_step_$GPU.json"
run 200 python3 bench_hybrid_step.py --variants ${KG_HYBRID_VARIANTS:-eager,kernelgate,fla_liger} --gdr chunked --out "$OUT/hybrid_step_$GPU.json"
