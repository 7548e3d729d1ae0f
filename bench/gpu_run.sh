#!/usr/bin/env bash
# On the GPU host: join the parts bench/gpu_parts.sh made (this project's wheel beside them) and run the GPU
# check in two environments.
# - The host's Python (its numpy 2, which its scipy and so sentence-transformers need), with the carried
#   wheels but numpy and the server first on PYTHONPATH: the in-process figures, the fidelity and the levers.
# - A venv of its own that sees the host's packages after its own, numpy<2 among them (the python
#   backend's: nexus-sli serve's): the served figures.
# Usage: bash bench/gpu_run.sh PARTS_DIR OUT_DIR [gpu_check options for both]
#   (IN_PROCESS_STEPS, SERVED_STEPS: each environment's --steps, for a second run that repeats part of one)
set -euo pipefail
parts=${1:?usage: gpu_run.sh PARTS_DIR OUT_DIR}; out=${2:?usage: gpu_run.sh PARTS_DIR OUT_DIR}
work=/tmp/nexus-sli-gpu-check; rm -rf "$work"; mkdir -p "$work" "$out"
cat "$parts"/part-* | tar -C "$work" -xf -
pip_install=(python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target)
cp "$parts"/nexus_sli-*.whl "$work/whl/"
host_wheels=()
for wheel in "$work"/whl/*.whl; do
  case "$(basename "$wheel")" in numpy-*|nvidia_pytriton-*) ;; *) host_wheels+=("$wheel");; esac
done
"${pip_install[@]}" "$work/site" "${host_wheels[@]}"
host_site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
python3 -m venv --without-pip "$work/env"  # python3 may itself be a venv's: its packages come through a .pth
env_site=$("$work/env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"${pip_install[@]}" "$env_site" "$work"/whl/*.whl
echo "$host_site" > "$env_site/host-packages.pth"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/nvidia-smi.csv" || true
check=(-m nexus_sli.bench.gpu_check --repository "$work/repo" --model all_minilm_l6_v2 --weights "$work/weights")
[ -d "$work/repo-fused" ] && check+=(--fused-repository "$work/repo-fused")  # parts made before bench/gpu_fused.py
PYTHONPATH="$work/site" python3 "${check[@]}" --out "$out/gpu-check-in-process.json" \
  --steps "${IN_PROCESS_STEPS:-environment,speed,joined,fidelity,validate,levers}" "${@:3}" \
  || echo "gpu_run: the in-process check exited $? (a CUDA graph capture can abort it); serving next"
"$work/env/bin/python" "${check[@]}" --out "$out/gpu-check-served.json" --serve-python "$work/env/bin/python" \
  --steps "${SERVED_STEPS:-environment,served}" "${@:3}"
