#!/usr/bin/env bash
# After training: assemble the diffusers folder, export it, pick guidance on held-out prompts,
# evaluate, write the card. Usage: finish.sh WORK MODEL_DIR ONNX_DIR [GUIDANCE_CANDIDATES...]
set -euo pipefail
WORK=${1:-runs/shapes-sd}; MODEL=${2:-models/shapes-sd}; ONNX=${3:-models/shapes-sd-onnx}; shift 3 || true
CANDIDATES=${*:-"2 3 4 5 7"}
PYBIN=${PYBIN:-.venv/bin}
export HF_HUB_OFFLINE=1
$PYBIN/python models/training/train_pipeline.py models/training/configs/shapes-sd.json --stage assemble --work "$WORK" --out "$MODEL"
$PYBIN/onnxdiffusion export "$MODEL" "$ONNX" --overwrite
best=""; best_score=-1
for g in $CANDIDATES; do
  # guidance is chosen on the calibration split, so the held-out numbers stay untouched by the choice
  $PYBIN/python - "$ONNX" "$g" <<'PY' > /tmp/guidance_$g.json
import json, sys
from onnxdiffusion.evaluate.run import EvaluateOptions, evaluate_model
r = evaluate_model(sys.argv[1], EvaluateOptions(count=96, guidance=float(sys.argv[2]), split="calib"), progress=False)
r.pop("_images")
print(json.dumps(r))
PY
  # accuracy first; the Frechet distance (scaled so 100 FD = 0.001) breaks ties between equal accuracies
  score=$($PYBIN/python -c "import json; r=json.load(open('/tmp/guidance_$g.json')); print(r['strict_accuracy'] + r['attribute_accuracy'] - 1e-5 * r['frechet_distance'])")
  echo "guidance $g: $(python3 -c "import json; r=json.load(open('/tmp/guidance_$g.json')); print('attr', round(r['attribute_accuracy'],3), 'strict', round(r['strict_accuracy'],3), 'FD', round(r['frechet_distance'],2))")"
  if python3 -c "import sys; sys.exit(0 if $score > $best_score else 1)"; then best=$g; best_score=$score; fi
done
echo "chosen guidance: $best"
$PYBIN/onnxdiffusion evaluate "$ONNX" --count 256 --guidance "$best" -o "$MODEL/eval.json"
$PYBIN/python models/training/make_card.py --work "$WORK" --model "$MODEL" --onnx "$ONNX" --eval "$MODEL/eval.json"
$PYBIN/python models/training/to_fp16.py "$MODEL"  # diffusers loads float16 files as float32
# the shipped ONNX copy comes from the float16 folder, weights stored float16 + Cast (lossless at load)
$PYBIN/python models/training/export_shipped.py "$MODEL" "$ONNX"
