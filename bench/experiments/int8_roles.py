"""NNCF int8 with SmoothQuant 0.75 and the MatMuls of one role kept fp32: no per-model search.

``.venv/bin/python -m nexus_sli.bench.experiments.int8_roles [REPO] [MODEL] [ROUNDS]``
(default: ``bench/.repo``, the bench's OpenVINO bf16 model, whose encoder is the
plain padding-trimmed graph the OpenVINO target quantizes; 15 rounds).  The
greedy per-layer search of :mod:`int8_levers` found a passing mix only after
about 50 quantizations; this asks whether keeping whole roles in fp32 (the
feed-forward output projections, :func:`quantize.ffn_output_matmuls`; the
attention output projections, :func:`quantize.attention_output_matmuls`) does
it in one.  Each graph's cosine to PyTorch fp32 over the same text groups as
:mod:`int8_levers` (calibration texts, their fragments, validation, bench,
bench texts not calibrated on), then its speed on the exporter's timing
workloads beside ONNX Runtime fp32 and OpenVINO fp32 and bf16, taking turns.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from nexus_sli.exporter.export.optimize import session
from nexus_sli.exporter.export.quantize import attention_output_matmuls, ffn_output_matmuls
from nexus_sli.exporter.export.source import resolve_model
from nexus_sli.exporter.export.timing import time_side_by_side, workloads
from nexus_sli.exporter.targets import TARGETS
from nexus_sli.exporter.targets.cpu import cpu_flags
from nexus_sli.exporter.targets.openvino_cpu import SMOOTH_QUANT_ALPHA

from . import MODEL, bench_repository
from .int8_levers import CALIBRATION, Run, nncf_int8


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoConfig

    argv = sys.argv[1:] if argv is None else argv
    repo = Path(argv[0]) if argv else bench_repository()
    model = argv[1] if len(argv) > 1 else f"{MODEL}_ov_bf16"
    rounds = int(argv[2]) if len(argv) > 2 else 15
    model_dir = resolve_model(None).path
    config = AutoConfig.from_pretrained(str(model_dir))
    work = Path(tempfile.mkdtemp(prefix="int8-roles-"))
    run = Run(repo, model, model_dir, work, CALIBRATION)
    ffn = ffn_output_matmuls(run.source, config.intermediate_size, config.hidden_size)
    attention = attention_output_matmuls(run.source, config.hidden_size)
    roles = {"nothing": [], "feed-forward outputs": ffn, "attention outputs": attention,
             "attention and feed-forward outputs": attention + ffn}
    ov = TARGETS["openvino"]
    runners = {"onnxruntime fp32": session(run.source),
               "openvino fp32": ov.open(run.source, ov.serving("fp32").parameters)}
    if cpu_flags() & {"avx512_bf16", "amx_bf16"}:
        runners["openvino bf16"] = ov.open(run.source, ov.serving("bf16").parameters)
    for index, (role, keep) in enumerate(roles.items()):
        path = nncf_int8(run.source, work / f"role-{index}.xml", run.calibration, SMOOTH_QUANT_ALPHA, keep)
        runner = ov.open(path, ov.serving("int8").parameters)
        fidelity = run.checker.fidelity(runner)
        text, cosine = fidelity.worst
        print(f"SmoothQuant {SMOOTH_QUANT_ALPHA}, fp32 kept: {role} ({len(keep)} MatMuls): cosine mean / min "
              f"{fidelity.describe()}{' (passes the bar)' if fidelity.passes() else ''}; worst bench text "
              f"{text[:40]!r} {cosine:.5f}", flush=True)
        runners[f"int8, {role} fp32"] = runner
    facts = run.facts
    loads = workloads(facts.tokenizer(), facts.input_names, facts.pad_id, facts.max_length)
    timings = time_side_by_side(list(runners.values()), loads, rounds)
    print(f"median ms over {rounds} rounds, taking turns:")
    for name, measured in zip(runners, timings):
        print(f"  {name:50} " + ", ".join(f"{load} {ms:.1f} ms" for load, ms in measured.items()), flush=True)


if __name__ == "__main__":
    main()
