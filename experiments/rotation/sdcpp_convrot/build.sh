#!/usr/bin/env bash
# Builds ggml_linear (this folder) against a ggml that carries stable-diffusion.cpp's int8 ConvRot ops
# (ggml_quantize_i8_convrot, ggml_mul_mat_i8_tensorwise, GGML_OP_QUANTIZE_I8_CONVROT): sd.cpp's own ggml fork
# (its submodule, leejet/ggml at 8e800cef for sd.cpp master of Aug 2026), or upstream ggml with those CPU ops
# put in (leejet's ggml-org/llama.cpp PR #28480; what experiments/rotation/sdcpp_convrot.md measured).
# Neither is on PyPI, so this is not part of `make peers`.
#   GGML_DIR=/path/to/ggml bash experiments/rotation/sdcpp_convrot/build.sh OUT_BINARY
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
: "${GGML_DIR:?GGML_DIR: a ggml source tree with the int8 ConvRot ops}"
out="${1:?output binary path}"
if [ ! -f "$GGML_DIR/build/src/libggml-cpu.a" ]; then
  cmake -S "$GGML_DIR" -B "$GGML_DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_OPENMP=ON \
    -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF
  cmake --build "$GGML_DIR/build" -j"$(nproc)"
fi
grep -q ggml_quantize_i8_convrot "$GGML_DIR/include/ggml.h" || { echo "this ggml has no int8 ConvRot ops" >&2; exit 1; }
b="$GGML_DIR/build/src"
cc -O2 -std=c11 -I"$GGML_DIR/include" "$here/ggml_linear.c" -o "$out" \
  "$b/libggml.a" "$b/libggml-cpu.a" "$b/libggml-base.a" -fopenmp -lstdc++ -lm -lpthread
echo "built $out"
