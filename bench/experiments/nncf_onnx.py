"""Issue 24 item 1, AVX2: NNCF static int8 of the ONNX graph (SmoothQuant, roles kept fp32), run by ONNX Runtime.

The OpenVINO candidate `plain+sq0.75+attn-ffn-out-fp32` keeps the bar, but OpenVINO's int8 is slower than
fp32 on AVX2; ONNX Runtime's int8 kernels are faster there. Same recipe, NNCF's ONNX backend, ORT runtime.

Run (findings: bench/data/tried.md, "ONNX Runtime static int8"):
    git show c81662c:bench/experiments/avx2_int8.py > bench/experiments/avx2_int8.py
    .venv/bin/python bench/experiments/nncf_onnx.py --roles "attn out,ffn out,ffn+attn out" --presets MIXED \
        --time all --runs 5 --rounds 5 [--model all-mpnet-base-v2] [--overflows ENABLE,FIRST_LAYER] [--unsorted] [--s8]
--s8 keeps NNCF's int8 activations (no to_u8); the steps before the Gather exclusion ran with ``types=["Gather"]``
left out of the IgnoredScope. The product's version of to_u8 is ``static_int8.unsigned_activations``.
"""
from __future__ import annotations

import argparse, logging, statistics, sys, tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from avx2_int8 import Study, Variant, Recipe, RECIPES, _time, report  # noqa: E402

from nexus_sli.exporter.export.pooling import pooling_nodes
from nexus_sli.exporter.targets.openvino_cpu import calibration_feeds


U8 = True
OVERFLOW = 'FIRST_LAYER'


def nncf_onnx(source: Path, target: Path, exclude: list[str], calibration, alpha, preset: str) -> Path:
    import nncf, onnx
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, AdvancedSmoothQuantParameters
    nncf.set_log_level(logging.WARNING)
    model = onnx.load(str(source))
    scope = nncf.IgnoredScope(names=list(exclude), types=["Gather"], validate=False)
    from nncf.quantization.advanced_parameters import OverflowFix
    adv = AdvancedQuantizationParameters(smooth_quant_alphas=AdvancedSmoothQuantParameters(matmul=-1 if alpha is None else alpha),
                                         overflow_fix=getattr(OverflowFix, OVERFLOW))
    q = nncf.quantize(model, nncf.Dataset(calibration), preset=getattr(nncf.QuantizationPreset, preset),
                      model_type=nncf.ModelType.TRANSFORMER, subset_size=sum(len(f["input_ids"]) for f in calibration),
                      ignored_scope=scope, advanced_parameters=adv)
    if U8:
        from to_u8 import to_u8; q = to_u8(q)
    onnx.save(q, str(target)); import shutil; shutil.copy(target, "/tmp/exp2/last_" + target.name)
    return target


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--alphas", default="0.75")
    p.add_argument("--model", default=None)
    p.add_argument("--overflows", default="")
    p.add_argument("--presets", default="MIXED")
    p.add_argument("--roles", default="ffn+attn out")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--time", default="all")
    p.add_argument("--baseline", default="s8 per-channel (exporter)")
    p.add_argument("--s8", action="store_true")
    p.add_argument("--unsorted", action="store_true")
    p.add_argument("--overflow", default="FIRST_LAYER")
    a = p.parse_args()
    global U8, OVERFLOW; U8 = not a.s8; OVERFLOW = a.overflow
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="nexus-nncf-onnx-") as work:
        study = Study(a.model, Path(work))
        g = study.graph
        from nexus_sli.exporter.targets.openvino_cpu import calibration_texts
        from nexus_sli.exporter.triton.python_models.encoding import encode
        texts = sorted(calibration_texts(), key=lambda t: len(g.tokenizer.encode(t).ids))
        calib = [encode(g.tokenizer, texts[i:i + 16], g.input_names, g.pad_id, g.max_length) for i in range(0, len(texts), 16)]
        if a.unsorted:
            calib = calibration_feeds(g.tokenizer, g.input_names, g.pad_id, g.max_length, g.task.pair)
        trimmed = study.sources["plain"]
        pool = []
        roles = {"none": [], "ffn out": g.ffn_outputs(trimmed), "attn out": g.attention_outputs(trimmed)}
        roles["ffn+attn out"] = roles["ffn out"] + roles["attn out"]
        variants = []
        if a.baseline:
            variants.append(study.make(Variant("plain", RECIPES[a.baseline], "none", [])))
        for preset in a.presets.split(","):
          for ov in (a.overflows.split(",") if a.overflows else [a.overflow]):
            OVERFLOW = ov
            for alpha in a.alphas.split(","):
                al = None if alpha == "off" else float(alpha)
                for role in a.roles.split(","):
                    name = f"NNCF-ONNX {preset} sq{alpha} overflow-fix {ov}"
                    v = Variant("plain", Recipe(name), role, roles[role])
                    out = Path(work) / f"nncf-{preset}-{ov}-{alpha}-{role.replace(' ', '_').replace('+', '')}.onnx"
                    import time; t0 = time.time()
                    v.path = g.trimmed(nncf_onnx(trimmed, out, roles[role] + pool, calib, al, preset))
                    print('  quantized in %.1f s' % (time.time() - t0), flush=True)
                    v.cosine_mean, v.cosine_min, v.passed = study.validate(v.path)
                    v.calibration = study.calibrate(v.path)
                    print(f"  {v.label}: validation {v.cosine_mean:.5f} / {v.cosine_min:.5f} "
                          f"({'passes' if v.passed else 'fails'}); calibration {v.calibration[0]:.5f} / {v.calibration[1]:.5f}", flush=True)
                    variants.append(v)
        timed = variants if a.time == "all" else [v for v in variants if v.passed]
        if timed and a.time != "none":
            fp32_runs = _time(study, timed, a.runs, a.rounds)
            report(study, timed, fp32_runs)


if __name__ == "__main__":
    main()
