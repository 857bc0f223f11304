#!/usr/bin/env bash
# Installs everything kernelgate needs and kernelgate itself: the system packages (SQLite and
# nlohmann-json for the evidence store, GoogleTest for the C++ tests: apt-get, when root and
# missing), the Python build and test requirements, then the package, built with its C++ tests
# into build/release.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! { [ -f /usr/include/gtest/gtest.h ] && [ -f /usr/include/sqlite3.h ] &&
        [ -f /usr/include/nlohmann/json.hpp ]; } &&
   command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  apt-get update -qq &&
    apt-get install -y -qq libgtest-dev libsqlite3-dev nlohmann-json3-dev >/dev/null
fi
# Chromium: the evidence report's PNG and its test in a real headless browser.
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  apt-get update -qq && apt-get install -y -qq chromium >/dev/null
fi
for h in gtest/gtest.h sqlite3.h nlohmann/json.hpp; do
  [ -f "/usr/include/$h" ] || { echo "missing /usr/include/$h: apt-get install libgtest-dev libsqlite3-dev nlohmann-json3-dev"; exit 1; }
done

"$PY" -m pip install -q -r requirements-dev.txt
"$PY" -m pip install -q --no-deps kernel-fun==0.2.0 quack-kernels==0.6.5  # see requirements-dev.txt
# One CMake build serves both the installed package and the C++ tests.
"$PY" -m pip install -q --no-build-isolation --no-deps \
  -C build-dir=build/release -C cmake.define.KERNELGATE_BUILD_TESTS=ON .
