#!/usr/bin/env bash
# Installs everything kernelgate needs and runs every test this machine can run:
# the C++ tests (CTest) and the Python tests (pytest); GPU tests too when a CUDA GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# GoogleTest for the C++ tests (Debian/Ubuntu package; needs root, as on CI).
if ! [ -f /usr/include/gtest/gtest.h ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  apt-get update -qq && apt-get install -y -qq libgtest-dev >/dev/null
fi
[ -f /usr/include/gtest/gtest.h ] || { echo "GoogleTest is missing: apt-get install libgtest-dev"; exit 1; }

"$PY" -m pip install -q -r requirements-dev.txt

# One CMake build serves both the installed package and the C++ tests.
"$PY" -m pip install -q --no-build-isolation --no-deps \
  -C build-dir=build/release -C cmake.define.KERNELGATE_BUILD_TESTS=ON .

if "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  ctest --test-dir build/release --output-on-failure --no-tests=error
  (cd tests/python && "$PY" -m pytest -q -p no:cacheprovider .)
else
  echo "no CUDA GPU here: GPU tests (label/marker 'gpu') are not run; run scripts/gpu_check.sh on a GPU machine"
  ctest --test-dir build/release --output-on-failure --no-tests=error -LE gpu
  (cd tests/python && "$PY" -m pytest -q -p no:cacheprovider -m "not gpu" .)
fi
