# Sourced by the GPU scripts: the build environment of a GPU machine.
PREFIX=${KG_PREFIX:-$PWD/.carry/prefix}
# The prefix's shared libraries (SQLite, Google Benchmark) where the machine has none.
export LD_LIBRARY_PATH="$PREFIX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16} PYTHONUNBUFFERED=1
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
# The system compiler where there is one: the H200 machine's default g++ is a wrapper toolchain
# (/opt/gcc), and we build with what its Python and torch were built against.
COMPILERS=()
if [ -x /usr/bin/g++ ]; then
  COMPILERS=(-C cmake.define.CMAKE_C_COMPILER=/usr/bin/gcc -C cmake.define.CMAKE_CXX_COMPILER=/usr/bin/g++
             -C cmake.define.CMAKE_CUDA_HOST_COMPILER=/usr/bin/g++)
fi

# On our H200 machine a library loaded into the process's global scope before libstdc++ shadows
# part of it, and our C++ code crashed when it threw an error formatting a double (e.g. a bad
# eps). Loading the system libstdc++ first avoids it; see docs/evidence.md. Call after building.
preload_libstdcxx() {
  local lib=/lib/x86_64-linux-gnu/libstdc++.so.6
  [ -f "$lib" ] && export LD_PRELOAD="$lib${LD_PRELOAD:+:$LD_PRELOAD}"
  return 0
}
