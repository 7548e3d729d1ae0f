#!/usr/bin/env bash
# On the GPU host: join the parts bench/gpu_parts.sh made, install its wheels and this project's
# beside the host's PyTorch (first on PYTHONPATH, shadowing a CPU onnxruntime), run the check.
# Usage: bash bench/gpu_run.sh PARTS_DIR OUT_DIR
set -euo pipefail
parts=${1:?usage: gpu_run.sh PARTS_DIR OUT_DIR}; out=${2:?usage: gpu_run.sh PARTS_DIR OUT_DIR}
work=/tmp/nexus-sli-gpu-check; rm -rf "$work"; mkdir -p "$work"
cat "$parts"/part-* | tar -C "$work" -xf -
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" \
  "$work"/whl/*.whl "$parts"/nexus_sli-*.whl
export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/nvidia-smi.csv" || true
python3 -m nexus_sli.bench.gpu_check --repository "$work/repo" --model all_minilm_l6_v2 \
  --weights "$work/weights" --out "$out/gpu-check.json" "${@:3}"
