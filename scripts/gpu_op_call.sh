#!/usr/bin/env bash
# One device call for an op: build, its GPU tests, then (KG_SWEEP_OP) its full bf16 sweep with the
# policy, within the call's time (KG_END seconds from the start, default 560). What comes back in
# $OUT: build_check.log, gpu_tests.log / .xml, sweep.log, shipped.tar, sweep_logs.tar (policy.txt).
# GPU tests on KG_TEST_N workers (default 4: with 8, attention's float64 oracle at seq 4096 ran
# the GPU out of memory in several workers at once), -v: each test's name and result print as it
# ends, so a run its time limit cuts still says which failed (with -q only dots reach the log).
#   OUT=$OUT KG_TEST_K=attention KG_TEST_FILES="test_attention.py test_contracts.py" \
#     KG_SWEEP_OP=attention bash scripts/gpu_op_call.sh
set -u
T0=$(date +%s)
KG_CUDA_ARCHS=90a-real KG_STEPS=build bash scripts/gpu_check.sh >"$OUT/build_check.log" 2>&1; echo "build rc=$? $(( $(date +%s) - T0 ))s"; tail -3 "$OUT/build_check.log"
source scripts/gpu_env.sh; preload_libstdcxx
(cd tests/python && timeout ${KG_TEST_S:-170} python3 -m pytest -v -rfE --tb=short -m gpu -n ${KG_TEST_N:-4} -k "${KG_TEST_K:-attention}" ${KG_TEST_FILES:-test_attention.py test_contracts.py} --junitxml="$OUT/gpu_tests.xml" >"$OUT/gpu_tests.log" 2>&1; echo "tests rc=$? $(( $(date +%s) - T0 ))s")
grep -E "(FAILED|ERROR) |^=.*(passed|failed)" "$OUT/gpu_tests.log" | tail -30
if [ -n "${KG_SWEEP_OP:-}" ]; then
  OUT=$OUT KG_NO_BUILD=1 KG_SWEEP_DEADLINE=$(( ${KG_END:-560} - ($(date +%s) - T0) )) KG_SWEEP_ARGS="--dtype bfloat16" KG_POLICY=1 bash scripts/gpu_sweep.sh "$KG_SWEEP_OP" full >"$OUT/sweep.log" 2>&1; echo "sweep rc=$? $(( $(date +%s) - T0 ))s"
  tail -15 "$OUT/sweep.log"
fi
