#!/usr/bin/env bash
# quack-kernels and its CuTe DSL runtime for the GPU machine (Python 3.12, no network). Its CUDA 13
# runtime wheel (92 MB) is more than one device call carries (64 MiB), so it travels in two parts.
#   here, once:        bash scripts/stage_quack.sh local      (downloads into .quack/a and .quack/b)
#   device call 1:     carry [".quack/a"]            bash scripts/stage_quack.sh device-a
#   device call 2, while the machine is warm (its /tmp is kept):
#                      carry [".carry", ".quack/b"]  bash scripts/stage_quack.sh device-b && ...
set -euo pipefail
QUACK=${QUACK_VERSION:-0.6.5}
DSL=${CUTLASS_DSL_VERSION:-4.8.1}
SPLIT=56000000  # bytes of the runtime wheel in part a
case "${1:-}" in
local)
  cd "$(dirname "$0")/.."
  grep -qx '/.quack/' .git/info/exclude 2>/dev/null || echo /.quack/ >>.git/info/exclude
  rm -rf .quack && mkdir -p .quack/a .quack/b .quack/dl
  plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat \
    -d .quack/dl "quack-kernels==$QUACK" "nvidia-cutlass-dsl==$DSL" "nvidia-cutlass-dsl-libs-base==$DSL" \
    "nvidia-cutlass-dsl-libs-core==$DSL" "nvidia-cutlass-dsl-libs-cu13==$DSL" "apache-tvm-ffi>=0.1.6,<0.2" \
    torch-c-dlpack-ext
  big=$(ls .quack/dl/nvidia_cutlass_dsl_libs_cu13-*.whl)
  head -c $SPLIT "$big" >.quack/a/part
  tail -c +$((SPLIT + 1)) "$big" >.quack/b/part
  basename "$big" >.quack/b/name
  mv $(ls .quack/dl/*.whl | grep -v libs_cu13) .quack/b/
  rm -rf .quack/dl
  du -sh .quack/a .quack/b
  ;;
device-a)
  mkdir -p /tmp/kg_quack && cp .quack/a/part /tmp/kg_quack/a && ls -la /tmp/kg_quack
  ;;
device-b)
  [ -f /tmp/kg_quack/a ] || { echo "no /tmp/kg_quack/a: run device-a on this machine first"; exit 1; }
  wheel=/tmp/kg_quack/$(cat .quack/b/name)
  cat /tmp/kg_quack/a .quack/b/part >"$wheel"
  # Into the environment itself (not --target): the DSL's .pth puts its packages on the path.
  python3 -m pip install -q --no-index --no-deps --no-compile "$wheel" .quack/b/*.whl
  python3 -c "import quack.rmsnorm, importlib.metadata as m; print('quack', m.version('quack-kernels'))"
  ;;
*)
  echo "usage: stage_quack.sh local | device-a | device-b"; exit 2
  ;;
esac
