#!/usr/bin/env bash
# One device call for an op: build, its GPU tests, then (KG_SWEEP_OP) its full bf16 sweep with the
# policy, within the call's time (KG_END seconds from the start, default 560). What comes back in
# $OUT: build_check.log, pytest_gpu.log / .xml / .rc, sweep.log, shipped.tar, sweep_logs.tar
# (policy.txt). The GPU tests are gpu_check.sh's test step (-v: a run its time limit cuts still
# names what failed) on KG_TEST_FILES with KG_TEST_K, within KG_TEST_S seconds (default 170), on
# KG_TEST_N workers (default 4: with 8, attention's float64 oracle at seq 4096 ran the GPU out of
# memory in several workers at once).
#   OUT=$OUT KG_TEST_K=attention KG_TEST_FILES="test_attention.py test_contracts.py" \
#     KG_SWEEP_OP=attention bash scripts/gpu_op_call.sh
set -u
T0=$(date +%s)
KG_CUDA_ARCHS=90a-real KG_STEPS=build bash scripts/gpu_check.sh >"$OUT/build_check.log" 2>&1; echo "build rc=$? $(( $(date +%s) - T0 ))s"; tail -3 "$OUT/build_check.log"
source scripts/gpu_env.sh; preload_libstdcxx
OUT=$OUT KG_STEPS=tests KG_TEST_K="${KG_TEST_K:-attention}" KG_TEST_PATHS="${KG_TEST_FILES:-test_attention.py test_contracts.py}" \
  KG_TEST_S=${KG_TEST_S:-170} KG_TEST_N=${KG_TEST_N:-4} bash scripts/gpu_check.sh | tail -30
echo "tests rc=$(cat "$OUT/pytest_gpu.rc") $(( $(date +%s) - T0 ))s"
if [ -n "${KG_SWEEP_OP:-}" ]; then
  OUT=$OUT KG_NO_BUILD=1 KG_SWEEP_DEADLINE=$(( ${KG_END:-560} - ($(date +%s) - T0) )) KG_SWEEP_ARGS="--dtype bfloat16" KG_POLICY=1 bash scripts/gpu_sweep.sh "$KG_SWEEP_OP" full >"$OUT/sweep.log" 2>&1; echo "sweep rc=$? $(( $(date +%s) - T0 ))s"
  tail -15 "$OUT/sweep.log"
fi
