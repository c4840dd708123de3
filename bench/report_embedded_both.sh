#!/usr/bin/env bash
# The bench of both embedded models side by side (issue 12) -> bench/report_embedded_both/.
#   nice -n 10 bash bench/report_embedded_both.sh        (about 15-25 min on 2 shared cores, 1 thread)
# Each model is copied (hard links) into runs/bench_both/ with its Loop graph compiled, its quantized variants
# made beside it (the recipes' defaults, calibrated at the model's recommended settings, --no-quality), then
# `onnxdiffusion bench A B` benches each with its own sampler/steps/guidance and joins them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OD=(env HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 TQDM_DISABLE=1 "$PY" -c "from onnxdiffusion.cli import main; main()")
WORK=runs/bench_both
OUT=${OUT:-bench/report_embedded_both}
REPEATS=${REPEATS:-5}
PROMPTS=${PROMPTS:-32}
mkdir -p "$WORK"
for m in shapes-sd-onnx shapes-mmdit-onnx; do
  if [ ! -f "$WORK/$m/manifest.json" ]; then
    rm -rf "$WORK/$m"; cp -al "models/$m" "$WORK/$m"
    "${OD[@]}" compile-loop "$WORK/$m" "$WORK/$m" --form loop
  fi
  for r in fp16 int8-dynamic int8-static int4-weights; do
    extra=()
    if [ "$r" = int4-weights ] && [ -n "${INT4_OPTS:-}" ]; then read -ra extra <<< "$INT4_OPTS"; fi  # e.g. "-O algorithm=gptq"
    [ -f "$WORK/$m-$r/manifest.json" ] || "${OD[@]}" quantize "$WORK/$m" "$WORK/$m-$r" --recipe "$r" --threads 1 --no-quality "${extra[@]}"
  done
done
rm -rf "$OUT"
"${OD[@]}" bench "$WORK/shapes-sd-onnx" "$WORK/shapes-mmdit-onnx" --threads 1 --repeats "$REPEATS" --prompts "$PROMPTS" \
  --variants torch-fp32,ort-fp32,ort-fp32-loop,ort-fp32-dpmpp,ort-fp16,ort-int8-dynamic,ort-int8-static,ort-int4-weights,optimum-ort,openvino-fp32 \
  --link-images --quiet --out "$OUT"
