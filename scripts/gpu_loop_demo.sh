#!/usr/bin/env bash
# On the H200 (device tool, carry [".carry"]): build the package for sm_90a, run the loop's
# demonstration (bench/loop_demo.py: JSON and log into $OUT) and the loop's GPU tests.
set -o pipefail
source scripts/gpu_env.sh
t0=$(date +%s)
python3 -m pip install -q --no-build-isolation --no-deps --no-index -C build-dir=build/h200 "${COMPILERS[@]}" -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90a-real -C cmake.define.CMAKE_PREFIX_PATH="$PREFIX" . > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
echo "build $(( $(date +%s)-t0 ))s"
preload_libstdcxx
timeout 400 python3 bench/loop_demo.py --out $OUT/loop_demo.json 2>&1 | tee $OUT/loop_demo.log
echo "demo done $(( $(date +%s)-t0 ))s"
cd tests/python && timeout $(( 560 - ($(date +%s)-t0) )) python3 -m pytest -q -p no:cacheprovider -m gpu -rA test_loop.py 2>&1 | tail -8 | cut -c1-300
echo "total $(( $(date +%s)-t0 ))s"
