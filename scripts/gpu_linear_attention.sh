#!/usr/bin/env bash
# On the GPU machine, in one call of at most KG_CALL_S seconds (default 560): build, then the
# linear-attention measurements the references' changes need, most needed first, each cut by what
# is left of the call and writing its JSON under $OUT as it goes:
#   1. the GPU tests of gated_delta_rule and kda (scripts/gpu_suite_summary.py -> suite_linear_attention.json)
#   2. bench_gated_delta_rule.py: gated_delta_rule at B4 T2048 and T4096 H16 K128 (where the memory
#      rule's margin is thinnest), with the reference's device time by ATen op (--profile; set
#      KG_GDR_PROFILE= to leave it out) -> gated_delta_rule.json
#   3. bench_hybrid_step.py --variants eager,kernelgate,fla_liger --gdr chunked -> hybrid_step.json,
#      then kda at T2048 -> kda.json
#   4. bench_reference_revisions.py --revs BASE,. --helpers: the references as they were at
#      KG_BASE_REV (default 86a5378: before the pass over the chunks gave the outputs) against the
#      checkout's -> reference_revisions.json. BASE is .carry/base_rev if it holds staged files (the
#      GPU machine's copy of the checkout may lack recent commits), else the revision itself; stage
#      it here before the call: bash scripts/gpu_linear_attention.sh --stage
# KG_TEST_K narrows the tests (a pytest -k expression, e.g. reference); KG_TESTS_CAP bounds them (s).
# FLA's and Liger's wheels in .carry/wheels are installed by the build step (scripts/gpu_check.sh).
#   OUT=... bash scripts/gpu_linear_attention.sh
set -uo pipefail
cd "$(dirname "$0")/.."
BASE_REV=${KG_BASE_REV:-86a5378}
if [ "${1:-}" = --stage ]; then  # on the machine with the repository's history
  rm -rf .carry/base_rev && mkdir -p .carry/base_rev
  for f in gated_delta_rule kda _state_scan _l2norm; do
    git show "$BASE_REV:python/kernelgate/$f.py" >".carry/base_rev/$f.py" 2>/dev/null || rm -f ".carry/base_rev/$f.py"
  done
  ls .carry/base_rev; exit 0
fi
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
T0=$(date +%s)
left() { echo $(( ${KG_CALL_S:-560} - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
KG_CUDA_ARCHS=${KG_CUDA_ARCHS:-90a-real} KG_STEPS=build bash scripts/gpu_check.sh >"$OUT/build_check.log" 2>&1 || { tail -20 "$OUT/build_check.log"; exit 1; }
echo "build: $(( $(date +%s) - T0 )) s"
source scripts/gpu_env.sh
preload_libstdcxx
CAP=${KG_TESTS_CAP:-150}  # the tests' share: at most half of what is left, and at most CAP
S=$(( $(left) / 2 < CAP ? $(left) / 2 : CAP ))
OUT=$OUT KG_STEPS=tests KG_TEST_PATHS="test_gated_delta_rule.py test_kda.py" KG_TEST_N=8 KG_TEST_S=$S \
  bash scripts/gpu_check.sh >/dev/null 2>&1
python3 scripts/gpu_suite_summary.py --part linear_attention --rc "$(cat "$OUT/pytest_gpu.rc")" --seconds "$S" \
  --files test_gated_delta_rule.py test_kda.py --log "$OUT/pytest_gpu.log" --out "$OUT/suite_linear_attention.json" | tail -1
cd bench
run() {  # run SECONDS_CAP command...: at most the cap, or what is left of the call
  local cap=$1; shift
  local t=$(( $(left) < cap ? $(left) : cap ))
  [ "$t" -gt 20 ] || { echo "not run (no time left): $*"; return; }
  timeout "$t" "$@" 2>&1 | tail -8
}
run 170 python3 bench_gated_delta_rule.py --shapes "4,2048,16,128;4,4096,16,128" ${KG_GDR_PROFILE---profile} --out "$OUT/gated_delta_rule.json"
run 200 python3 bench_hybrid_step.py --variants eager,kernelgate,fla_liger --gdr chunked --out "$OUT/hybrid_step.json"
run 120 python3 bench_gated_delta_rule.py --op kda --shapes 4,2048,16,128 --out "$OUT/kda.json"
BASE=$BASE_REV; [ -f ../.carry/base_rev/kda.py ] && BASE=../.carry/base_rev
run 120 python3 bench_reference_revisions.py --revs "$BASE,." --helpers --shapes 4,2048,16,128 \
  --out "$OUT/reference_revisions.json"
echo "done: $(( $(date +%s) - T0 )) s"
