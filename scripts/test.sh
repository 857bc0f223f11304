#!/usr/bin/env bash
# Installs everything kernelgate needs and runs every test this machine can run:
# the C++ tests (CTest) and the Python tests (pytest); GPU tests too when a CUDA GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# SQLite (the evidence store) and GoogleTest (the C++ tests): Debian/Ubuntu packages; installed
# here when missing and we are root, as on CI.
if ! { [ -f /usr/include/gtest/gtest.h ] && [ -f /usr/include/sqlite3.h ]; } &&
   command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  apt-get update -qq && apt-get install -y -qq libgtest-dev libsqlite3-dev >/dev/null
fi
for h in gtest/gtest.h sqlite3.h; do
  [ -f "/usr/include/$h" ] || { echo "missing /usr/include/$h: apt-get install libgtest-dev libsqlite3-dev"; exit 1; }
done

"$PY" -m pip install -q -r requirements-dev.txt

# One CMake build serves both the installed package and the C++ tests.
"$PY" -m pip install -q --no-build-isolation --no-deps \
  -C build-dir=build/release -C cmake.define.KERNELGATE_BUILD_TESTS=ON .

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
