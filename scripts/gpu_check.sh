#!/usr/bin/env bash
# On a GPU machine: build (with C++ tests and benchmarks), run the C++ tests, the GPU tests and
# the benchmarks; logs and JSON go to $OUT (default ./gpu_out). Prints a short summary last.
# Where GoogleTest / Google Benchmark are not installed, a prefix holding them can be given as
# KG_PREFIX (include/ and lib/, lib/cmake/benchmark).
#   KG_STEPS="build ctest tests demo benchmarks dispatch"   the steps to run (default: all)
#   KG_CUDA_ARCHS=90a-real                                  build for these CUDA architectures only
# Each GPU test failure is written to $OUT/pytest_failures.log as it happens (KG_FAILURE_LOG in
# tests/python/conftest.py). For one pair: scripts/oracle_diag.py (the float64 oracle) and
# scripts/capture_diag.py (CUDA-graph capture, library direct vs routed).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
source scripts/gpu_env.sh
status=0

STEPS=${KG_STEPS:-build ctest tests demo benchmarks dispatch}
want() { [[ " $STEPS " == *" $1 "* ]]; }
step() { echo "== $1"; }
ARCHS=(); [ -n "${KG_CUDA_ARCHS:-}" ] && ARCHS=(-C "cmake.define.CMAKE_CUDA_ARCHITECTURES=$KG_CUDA_ARCHS")

if want build; then
step build
# Python packages the benchmarks compare against (e.g. Liger-Kernel), carried as wheels: the GPU
# machine has no network.
if ls .carry/wheels/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-deps --no-index .carry/wheels/*.whl >"$OUT/wheels.log" 2>&1 || tail -5 "$OUT/wheels.log"
fi
"$PY" -c 'import sysconfig, os, torch; inc = sysconfig.get_paths()["include"]; print("python", sysconfig.get_python_version(), "headers", inc, os.path.exists(os.path.join(inc, "Python.h")), "torch", torch.__version__)'
start=$(date +%s)
if ! "$PY" -m pip install --no-build-isolation --no-deps --no-index -v \
    -C build-dir=build/h200 "${COMPILERS[@]}" "${ARCHS[@]}" -C cmake.define.KERNELGATE_BUILD_TESTS=ON \
    -C cmake.define.CMAKE_PREFIX_PATH="$PREFIX" -C cmake.define.GTEST_ROOT="$PREFIX" . \
    >"$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"
  echo "BUILD FAILED"
  exit 1
fi
echo "build: $(( $(date +%s) - start )) s; $(grep -o 'CUDA kernels [A-Z]*' "$OUT/build.log" | head -1)"
fi

preload_libstdcxx
export KERNELGATE_TEST_PLUGIN="$PWD/build/h200/tests/cpp/libkgtest_faulty.so"

if want ctest; then
step "C++ tests"
ctest --test-dir build/h200 --output-on-failure >"$OUT/ctest.log" 2>&1 || status=1
tail -3 "$OUT/ctest.log"
fi

if want tests; then
step "GPU tests"
# pytest-xdist where installed (KG_TEST_N workers, default 8): the GPU tests' float64 oracles run
# on the CPU.
XDIST=(); "$PY" -c "import xdist" 2>/dev/null && XDIST=(-n "${KG_TEST_N:-8}")
# -v: each test's name and result print as it ends, so a run cut by a time limit still says which
# failed; KG_TEST_PATHS are the files (default: all), KG_TEST_K a -k expression (e.g. "liger or
# fla"), KG_PYTEST_ARGS more arguments; KG_TEST_TIMEOUT bounds each test, KG_TEST_S the whole run.
# pytest's exit status goes to pytest_gpu.rc (124: the run was cut by KG_TEST_S).
TIMEOUT=(); "$PY" -c "import pytest_timeout" 2>/dev/null && TIMEOUT=(--timeout="${KG_TEST_TIMEOUT:-300}")
LIMIT=(); [ -n "${KG_TEST_S:-}" ] && LIMIT=(timeout "$KG_TEST_S")
K=(); [ -n "${KG_TEST_K:-}" ] && K=(-k "$KG_TEST_K")
(cd tests/python && KG_FAILURE_LOG="$OUT/pytest_failures.log" "${LIMIT[@]}" "$PY" -m pytest -v -rfE --tb=short -p no:cacheprovider -m gpu "${XDIST[@]}" "${TIMEOUT[@]}" \
   "${K[@]}" --junitxml="$OUT/pytest_gpu.xml" ${KG_PYTEST_ARGS:-} ${KG_TEST_PATHS:-.} ) >"$OUT/pytest_gpu.log" 2>&1
rc=$?; echo $rc >"$OUT/pytest_gpu.rc"; [ $rc -eq 0 ] || status=1
grep -E "(FAILED|ERROR) |passed|failed" "$OUT/pytest_gpu.log" | tail -25
fi

if want demo; then
step "main job (kernelgate demo)"
kernelgate demo >"$OUT/demo.log" 2>&1 || status=1
grep -E "^rms_norm ->|passed" "$OUT/demo.log"
fi

if want benchmarks; then
step benchmarks
(cd bench && "$PY" bench_rms_norm.py --out "$OUT/rms_norm.json") 2>&1 | tail -12 || status=1
for b in gated add_rms_norm layer_norm rope cross_entropy linear_cross_entropy causal_conv1d; do
  (cd bench && "$PY" "bench_$b.py" --out "$OUT/$b.json") 2>&1 | tail -14 || status=1
done
fi
if want dispatch; then
step dispatch
(cd bench && "$PY" bench_dispatch.py --lib ../build/h200/bench/cpp/libkgbench_ops.so \
  --out "$OUT/dispatch.json") 2>&1 | tail -6 || status=1
if [ -x build/h200/bench/cpp/dispatch_bench ]; then
  build/h200/bench/cpp/dispatch_bench --benchmark_min_time=0.5 --benchmark_out="$OUT/dispatch_cpp.json" \
    --benchmark_out_format=json 2>&1 | tail -5
fi
fi
# KG_PACK=1: everything under $OUT as one archive (for transports that bring back few files).
if [ -n "${KG_PACK:-}" ]; then
  tar -czf /tmp/gpu_check.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/gpu_check.tgz "$OUT/"
fi
exit $status
