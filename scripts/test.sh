#!/usr/bin/env bash
# Installs everything kernelgate needs and runs every test this machine can run:
# the C++ tests (CTest) and the Python tests (pytest); GPU tests too when a CUDA GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

bash scripts/setup.sh

# The test-only faulty backends that the harness tests load into workers.
export KERNELGATE_TEST_PLUGIN="$PWD/build/release/tests/cpp/libkgtest_faulty.so"

if "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  ctest --test-dir build/release --output-on-failure --no-tests=error
  (cd tests/python && "$PY" -m pytest -q -p no:cacheprovider .)
else
  echo "no CUDA GPU here: GPU tests (label/marker 'gpu') are not run; run scripts/gpu_check.sh on a GPU machine"
  ctest --test-dir build/release --output-on-failure --no-tests=error -LE gpu
  (cd tests/python && "$PY" -m pytest -q -p no:cacheprovider -m "not gpu" .)
fi
