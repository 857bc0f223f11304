#!/usr/bin/env bash
# Builds .carry/prefix: what the GPU machine lacks for a full build (GoogleTest, Google Benchmark,
# the SQLite and nlohmann-json headers), from this machine's Debian packages. Carry it with the device tool
# (carry: [".carry"]); scripts/gpu_check.sh uses it. The GPU machine's own libsqlite3.so.0 serves
# at run time.
set -euo pipefail
cd "$(dirname "$0")/.."
P=.carry/prefix
mkdir -p "$P/include" "$P/lib/cmake/benchmark"
cp -r /usr/include/gtest /usr/include/gmock /usr/include/benchmark /usr/include/sqlite3.h \
  /usr/include/sqlite3ext.h /usr/include/nlohmann "$P/include/"
cp /usr/lib/x86_64-linux-gnu/libgtest.a /usr/lib/x86_64-linux-gnu/libgtest_main.a "$P/lib/"
cp -L /usr/lib/x86_64-linux-gnu/libbenchmark.so.1debian "$P/lib/"
cp -L /usr/lib/x86_64-linux-gnu/libsqlite3.so "$P/lib/libsqlite3.so"
cat > "$P/lib/cmake/benchmark/benchmarkConfig.cmake" <<'CFG'
# Minimal config for the carried Google Benchmark shared library.
get_filename_component(_kg_prefix "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
add_library(benchmark::benchmark SHARED IMPORTED)
set_target_properties(benchmark::benchmark PROPERTIES
  IMPORTED_LOCATION "${_kg_prefix}/lib/libbenchmark.so.1debian"
  INTERFACE_INCLUDE_DIRECTORIES "${_kg_prefix}/include")
set(benchmark_FOUND TRUE)
CFG
echo "built $P ($(du -sh "$P" | cut -f1))"
