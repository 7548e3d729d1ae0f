#!/usr/bin/env bash
# On the GPU host, with gpu_parts.sh's parts and, beside them in PARTS_DIR, the wheels of this project,
# nvidia-pytriton and numpy<2 (the python backend's): install into the host's Python in place of its CPU
# onnxruntime, as docs/gpu.md tells a user to; then `nexus-sli validate` as a command (also with the
# default export's TensorRT accelerator, where PARTS_DIR has its encoder config as tensorrt.config.pbtxt),
# the repository served by Triton on the GPU through the client, and the cost of padding there.
# Usage: bash bench/gpu_serve.sh PARTS_DIR OUT_DIR [gpu_check options]
set -euo pipefail
parts=${1:?usage: gpu_serve.sh PARTS_DIR OUT_DIR}; out=${2:?usage: gpu_serve.sh PARTS_DIR OUT_DIR}
work=/tmp/nexus-sli-gpu-serve; rm -rf "$work"; mkdir -p "$work"
cat "$parts"/part-* | tar -C "$work" -xf -
python3 -m pip uninstall -y -q onnxruntime
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$work"/whl/*.whl "$parts"/*.whl
export PYTHONUNBUFFERED=1
repo=$work/repo model=all_minilm_l6_v2
# whether CUDA's libraries load here from the library path alone, without onnxruntime's preload
python3 -c 'import onnxruntime as o, sys; print(o.InferenceSession(sys.argv[1], providers=["CUDAExecutionProvider"]).get_providers())' \
  "$repo/${model}_encoder/1/model.onnx" > "$out/without-preload.txt" 2>&1 || true
python3 -m nexus_sli.cli.main validate --repository "$repo" --model "$model" | tee "$out/validate-command.json" || true
if [ -f "$parts/tensorrt.config.pbtxt" ]; then
  cp -r "$repo" "$work/repo-tensorrt" && cp "$parts/tensorrt.config.pbtxt" "$work/repo-tensorrt/${model}_encoder/config.pbtxt"
  python3 -m nexus_sli.cli.main validate --repository "$work/repo-tensorrt" --model "$model" \
    > "$out/validate-tensorrt-config.txt" 2>&1 || true
fi
python3 -m nexus_sli.bench.gpu_check --repository "$repo" --model "$model" --out "$out/gpu-serve.json" \
  --steps environment,served,padding "${@:3}"
