#!/usr/bin/env bash
# The whole GPU test suite in parts that each fit one device call, on a machine where the package
# is built (scripts/gpu_check.sh with KG_STEPS=build): each part is gpu_check.sh's GPU test step
# on its files within KG_SUITE_S seconds (-v: every result's name reaches the log as it ends, so
# a part its time limit cuts still says what passed and what failed), and
# scripts/gpu_suite_summary.py writes $OUT/suite_<part>.json (counts, the failed and unfinished
# tests) from its log, kept as $OUT/suite_<part>.log.
#   OUT=$OUT KG_SUITE_S=450 bash scripts/gpu_suite.sh contracts
# Parts: contracts (test_compile.py, test_contracts.py), ops (the wave-1 ops' files), models
# (attention, linear attention, causal_conv1d, the libraries, the drop-in, the loop).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
part=${1:-}
case "$part" in
contracts) files="test_compile.py test_contracts.py"; workers=6 ;;
ops) files="test_rms_norm.py test_add_rms_norm.py test_layer_norm.py test_rope.py test_gated.py test_cross_entropy.py test_linear_cross_entropy.py"; workers=8 ;;
# attention's float64 oracle at seq 4096 ran the GPU out of memory with 8 workers at once
models) files="test_attention.py test_gated_delta_rule.py test_kda.py test_causal_conv1d.py test_library_backends.py test_fla_dropin.py test_loop.py"; workers=4 ;;
*) echo "usage: gpu_suite.sh contracts | ops | models"; exit 2 ;;
esac
t0=$(date +%s)
OUT=$OUT KG_STEPS=tests KG_TEST_PATHS="$files" KG_TEST_N="${KG_SUITE_N:-$workers}" KG_TEST_S="${KG_SUITE_S:-450}" \
  bash scripts/gpu_check.sh >/dev/null
mv "$OUT/pytest_gpu.log" "$OUT/suite_$part.log"
python3 scripts/gpu_suite_summary.py --part "$part" --rc "$(cat "$OUT/pytest_gpu.rc")" \
  --seconds $(( $(date +%s) - t0 )) --files $files --log "$OUT/suite_$part.log" --out "$OUT/suite_$part.json"
