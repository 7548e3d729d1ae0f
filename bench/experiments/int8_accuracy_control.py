"""NNCF accuracy-controlled int8 of an exported encoder: does it keep the auto bar, and does it pay?

``.venv/bin/python -m nexus_sli.bench.experiments.int8_accuracy_control REPO MODEL``
quantizes the fp32 ONNX graph of ``REPO/MODEL_encoder`` (an embedding export)
with ``nncf.quantize_with_accuracy_control``: calibrated and controlled on the
project's calibration texts (never the validation texts), with the *minimum*
embedding cosine to the fp32 graph as the metric, so NNCF reverts the most
sensitive operations to fp32 until that minimum drops no more than
``--max-drop``.  It then prints the result's cosine to the fp32 graph over the
240 validation texts (which the export's validation uses) and the time of a
batch of 32 mixed-length validation texts against OpenVINO fp32 and bf16 of the
same graph, timed side by side (:mod:`export.timing`).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import numpy as np

from nexus_sli.exporter.export.timing import time_side_by_side, workloads
from nexus_sli.exporter.export.validate import validation_texts
from nexus_sli.exporter.targets.cpu import cpu_flags
from nexus_sli.exporter.targets.openvino_cpu import OpenVINOSession, calibration_feeds
from nexus_sli.exporter.triton import config as tc
from nexus_sli.exporter.triton.python_models.encoding import encode, l2_normalize, load_tokenizer, pool


def _embeddings(run, feeds_list: list[dict]) -> list[np.ndarray]:
    return [l2_normalize(_pooled(run(feeds), feeds["attention_mask"])) for feeds in feeds_list]


def _pooled(output: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """A graph that pools answers [batch, hidden]; an earlier one's token states are mean-pooled here."""
    return output if output.ndim == 2 else pool(output, mask[:, :output.shape[1]], "mean")


def _cosines(a: list[np.ndarray], b: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([(x * y).sum(axis=1) for x, y in zip(a, b)])


def main(argv: list[str] | None = None) -> None:
    import nncf
    import openvino as ov

    parser = argparse.ArgumentParser()
    parser.add_argument("repo", type=Path)
    parser.add_argument("model")
    parser.add_argument("--max-drop", type=float, default=0.01)
    args = parser.parse_args(argv)
    nncf.set_log_level(logging.WARNING)
    encoder = args.repo / f"{args.model}_encoder"
    graph = encoder / "1" / "model.onnx"
    inputs = [i.name for i in tc.read(encoder / "config.pbtxt").input]
    tokenizer_dir = args.repo / f"{args.model}_tokenizer"
    params = {k: v.string_value for k, v in tc.read(tokenizer_dir / "config.pbtxt").parameters.items()}
    max_length, pad_id = int(params["max_length"]), int(params["pad_id"])
    tokenizer = load_tokenizer(tokenizer_dir / "1" / "tokenizer.json", max_length)

    core = ov.Core()
    fp32 = core.compile_model(core.read_model(str(graph)), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    run_fp32 = lambda feeds: fp32(feeds)[0]  # noqa: E731
    calibration = calibration_feeds(tokenizer, inputs, pad_id, max_length, False)
    reference = _embeddings(run_fp32, calibration)

    def min_cosine(compiled, items) -> tuple[float, list[float]]:
        # items are (feeds, fp32 embeddings) pairs: NNCF also validates on subsets of them
        per_item = [float(_cosines(_embeddings(lambda f: compiled(f)[0], [feeds]), [truth]).min())
                    for feeds, truth in items]
        return min(per_item), per_item

    validation = nncf.Dataset(list(zip(calibration, reference)))
    quantized = nncf.quantize_with_accuracy_control(
        core.read_model(str(graph)), nncf.Dataset(calibration), validation, min_cosine,
        max_drop=args.max_drop, model_type=nncf.ModelType.TRANSFORMER, subset_size=len(calibration))
    int8 = core.compile_model(quantized, "CPU")

    texts = validation_texts()
    batches = [encode(tokenizer, texts[i:i + 16], inputs, pad_id, max_length) for i in range(0, len(texts), 16)]
    truth = _embeddings(run_fp32, batches)
    cosines = _cosines(_embeddings(lambda feeds: int8(feeds)[0], batches), truth)
    print(f"accuracy-controlled int8 (max drop {args.max_drop}): validation cosine to fp32 "
          f"mean {cosines.mean():.5f} min {cosines.min():.5f}", flush=True)

    work = Path("/tmp/nexus-ac-int8")
    work.mkdir(exist_ok=True)
    ov.save_model(quantized, str(work / "model.xml"), compress_to_fp16=False)
    runners = {"openvino fp32": OpenVINOSession(graph, {"HINT_BF16": "NO"}),
               "openvino int8 (accuracy-controlled)": OpenVINOSession(work / "model.xml", {"HINT_BF16": "NO"})}
    if cpu_flags() & {"avx512_bf16", "amx_bf16"}:
        runners["openvino bf16"] = OpenVINOSession(graph, {"HINT_BF16": "YES"})
    loads = workloads(tokenizer, inputs, pad_id, max_length)
    flags = " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "amx"))))
    print(f"side by side on {', '.join(load.describe() for load in loads)}; CPU flags: {flags}")
    for name, timings in zip(runners, time_side_by_side(list(runners.values()), loads, rounds=9)):
        print(f"  {name}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in timings.items()), flush=True)


if __name__ == "__main__":
    main()
