"""Parity (fp32) and fidelity (int8) of an exported graph against PyTorch fp32.

Checks run in the order optimum's validator uses: output names, then shapes,
then values, and every failure is collected before deciding.  Inputs differ
from the export example: batch 1 and 5, padded rows, and a sequence near the
position limit, plus a fixed, project-written set of texts for fidelity.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import numpy as np
import torch

from .padding_trim import trimmed_length
from nexus_sli.exporter.triton.python_models.encoding import encode, l2_normalize, pool
from nexus_sli.tasks.spec import Task

REFERENCE = "pytorch-fp32"
#: Embeddings: token states within 1e-4 (fp32); sentence-embedding cosine (bf16, int8).
THRESHOLDS: dict[str, dict[str, float]] = {
    "fp32": {"max_abs_diff": 1e-4},
    "bf16": {"cosine_mean": 0.9999, "cosine_min": 0.999},
    "int8": {"cosine_mean": 0.99, "cosine_min": 0.95},
}
#: Tasks with labels or spans: the same argmax as PyTorch fp32.
LABEL_THRESHOLDS: dict[str, dict[str, float]] = {
    "fp32": {"max_abs_diff": 1e-4, "agreement": 1.0},
    "bf16": {"agreement": 0.99},
    "int8": {"agreement": 0.98},
}
#: OpenVINO int8 (NNCF static quantization, calibrated) is held to a higher bar than
#: ONNX Runtime's dynamic int8: the fidelity the speed targets of the bench require.
STATIC_INT8_THRESHOLDS = {"cosine_mean": 0.995, "cosine_min": 0.98}


def thresholds(task: Task, precision: str, backend: str = "onnxruntime") -> dict[str, float]:
    if backend == "openvino" and precision == "int8" and not task.agreement:
        return STATIC_INT8_THRESHOLDS
    return (LABEL_THRESHOLDS if task.agreement else THRESHOLDS)[precision]


#: Longest sequence the parity check runs (attention cost grows with its square).
LONG_CASE_CAP = 1024
TEXT_BATCH = 16


def validation_texts() -> list[str]:
    text = resources.files("nexus_sli.exporter.export").joinpath("data/validation_texts.txt").read_text("utf-8")
    return [line for line in text.splitlines() if line.strip()]


def parity_cases(input_names: list[str], vocab_size: int, pad_id: int, long_len: int) -> list[dict[str, np.ndarray]]:
    """Token batches of shapes other than the export example's (2 x 16), one of them
    padded past its longest row, as the served tokenizer pads (the graph cuts it off)."""
    rng = np.random.default_rng(1234)
    cases = []
    long_len = min(long_len, LONG_CASE_CAP)
    for lengths, width in (([7], 7), ([23, 17, 9, 3, 2], 23), ([11, 5], 40), ([long_len], long_len)):
        batch = len(lengths)
        ids = rng.integers(5, max(vocab_size, 6), size=(batch, width), dtype=np.int64)
        ids[ids == pad_id] = pad_id + 1 if pad_id + 1 < vocab_size else pad_id - 1
        mask = np.zeros((batch, width), dtype=np.int64)
        for row, n in enumerate(lengths):
            mask[row, :n] = 1
            ids[row, n:] = pad_id
        feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
        cases.append({name: feeds[name] for name in input_names})
    return cases


@dataclass
class Embedder:
    """How token states become the served embedding (pooling, normalisation)."""

    pooling: str
    normalize: bool

    def __call__(self, hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
        vectors = pool(hidden, mask, self.pooling)
        return l2_normalize(vectors) if self.normalize else vectors


@dataclass
class Reference:
    input_names: list[str]
    output_names: list[str]
    batches: list[dict[str, np.ndarray]] = field(default_factory=list)
    outputs: list[list[np.ndarray]] = field(default_factory=list)
    text_batches: int = 0

    def add(self, feeds: dict[str, np.ndarray], outputs: list[np.ndarray]) -> None:
        self.batches.append(feeds)
        self.outputs.append(outputs)


def build_reference(model: torch.nn.Module, task: Task, input_names: list[str], cases, text_batches) -> Reference:
    """PyTorch fp32 outputs for the parity cases and the text batches, computed once."""
    reference = Reference(input_names, task.output_names())
    with torch.no_grad():
        for feeds in [*cases, *text_batches]:
            output = model(**{k: torch.from_numpy(v) for k, v in feeds.items()}, return_dict=True)
            reference.add(feeds, [t.detach().numpy() for t in task.select_outputs(output)])
    reference.text_batches = len(text_batches)
    return reference


def text_batches(tokenizer, input_names: list[str], pad_id: int, max_length: int,
                 pairs: bool = False) -> list[dict[str, np.ndarray]]:
    texts = validation_texts()
    if pairs:  # each text with the next one: (query, document) / (question, context) shaped
        texts = list(zip(texts, texts[1:] + texts[:1]))
    return [
        encode(tokenizer, texts[i : i + TEXT_BATCH], input_names, pad_id, max_length)
        for i in range(0, len(texts), TEXT_BATCH)
    ]


def _masked_max_diff(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> float:
    diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
    if diff.ndim >= 2 and diff.shape[:2] == mask.shape:
        diff = diff[mask.astype(bool)]  # padded positions carry no meaning
    return float(diff.max()) if diff.size else 0.0


#: Two reference scores closer than the fp32 parity tolerance are a tie: the error fp32
#: parity allows can order them either way, so they are no decision to agree on.
TIE_MARGIN = THRESHOLDS["fp32"]["max_abs_diff"]


def _top_two_gap(scores: np.ndarray) -> np.ndarray:
    """Best minus second-best score; inf for a single score, nan (a tie) where both are -inf (masked)."""
    if scores.shape[-1] < 2:
        return np.full(scores.shape[:-1], np.inf)
    top = np.sort(scores, axis=-1)
    with np.errstate(invalid="ignore"):
        return top[..., -1] - top[..., -2]


def _agreement(kind: str, got: list[np.ndarray], expected: list[np.ndarray], mask: np.ndarray) -> tuple[int, int, int]:
    """(agreeing, total, ties) decisions of ``got`` vs ``expected`` for one batch.

    Decisions where the reference itself is a tie (:data:`TIE_MARGIN`) are counted
    in ``ties`` and left out of the other two."""
    agree = total = ties = 0
    for g, e in zip(got, expected):
        if kind == "rows":
            same, decided = g.argmax(-1) == e.argmax(-1), _top_two_gap(e) > TIE_MARGIN
        elif kind == "tokens":
            real = mask.astype(bool)
            same, decided = (g.argmax(-1) == e.argmax(-1))[real], (_top_two_gap(e) > TIE_MARGIN)[real]
        elif kind == "span":
            gm, em = np.where(mask > 0, g, -np.inf), np.where(mask > 0, e, -np.inf)
            same, decided = gm.argmax(-1) == em.argmax(-1), _top_two_gap(em) > TIE_MARGIN
        else:  # "order": every pair of rows ranked the same way
            dg, de = g[:, 0][:, None] - g[:, 0][None, :], e[:, 0][:, None] - e[:, 0][None, :]
            upper = np.triu_indices(len(g), 1)
            same, decided = np.sign(dg[upper]) == np.sign(de[upper]), np.abs(de[upper]) > TIE_MARGIN
        agree += int((same & decided).sum())
        total += int(decided.sum())
        ties += int((~decided).sum())
    return agree, total, ties


def compare(session: Any, reference: Reference, precision: str, embedder: Embedder | None,
            task: Task | None = None, backend: str = "onnxruntime") -> dict:
    """Run ``session`` on the reference inputs; the validation report.

    Per-token outputs (``task.per_token``) must come back cut to the batch's
    longest real token (:func:`trimmed_length`), as the exported graph's padding
    trim cuts them, and are compared with PyTorch's over that length."""
    failures: list[str] = []
    first_text = len(reference.batches) - reference.text_batches
    graph_inputs = [i.name for i in session.get_inputs()]
    graph_outputs = [o.name for o in session.get_outputs()]
    if graph_inputs != reference.input_names:
        failures.append(f"graph inputs {graph_inputs} != model inputs {reference.input_names}")
    if graph_outputs != reference.output_names:
        failures.append(f"graph outputs {graph_outputs} != expected {reference.output_names}")
    max_diff, cosines, agree, decisions, ties = 0.0, [], 0, 0, 0
    if not failures:
        for index, (feeds, expected) in enumerate(zip(reference.batches, reference.outputs)):
            try:
                got = session.run(None, feeds)
            except Exception as exc:  # runtimes report graph errors (baked shapes, bad indices) this way
                failures.append(f"{backend} failed on input shape {feeds['input_ids'].shape}: {str(exc)[:300]}")
                break
            mask = feeds["attention_mask"]
            if task is not None and task.per_token:
                length = trimmed_length(mask)
                expected, mask = [e[:, :length] for e in expected], mask[:, :length]
            for name, g, e in zip(reference.output_names, got, expected):
                if g.shape != e.shape:
                    failures.append(f"{name}: shape {g.shape} != {e.shape} for input shape {feeds['input_ids'].shape}")
                    continue
                max_diff = max(max_diff, _masked_max_diff(g, e, mask))
            if index < first_text or failures:
                continue
            if embedder is not None:
                a = embedder(got[0], mask)
                b = embedder(expected[0], mask)
                cosines.extend(np.sum(l2_normalize(a) * l2_normalize(b), axis=-1).tolist())
            if task is not None and task.agreement:
                a, n, t = _agreement(task.agreement, got, expected, mask)
                agree, decisions, ties = agree + a, decisions + n, ties + t
    limits = thresholds(task, precision, backend) if task is not None else THRESHOLDS[precision]
    report = {
        "precision": precision,
        "backend": backend,
        "reference": REFERENCE,
        "max_abs_diff": max_diff,
        "cosine_min": float(min(cosines)) if cosines else None,
        "cosine_mean": float(np.mean(cosines)) if cosines else None,
        "agreement": agree / decisions if decisions else None,
        "decisions": decisions,
        "ties": ties,
        "thresholds": limits,
        "texts": sum(len(b["input_ids"]) for b in reference.batches[first_text:]),
    }
    if not failures:
        failures.extend(_threshold_failures(report, limits))
    report["failures"] = failures
    report["passed"] = not failures
    return report


def _threshold_failures(report: dict, thresholds: dict[str, float]) -> list[str]:
    failures = []
    for metric, limit in thresholds.items():
        value = report[metric]
        if value is None and metric == "agreement" and report.get("ties"):
            failures.append(f"agreement could not be measured: all {report['ties']} decisions were ties "
                            f"(PyTorch's own scores within {TIE_MARGIN:g})")
        elif value is None:
            failures.append(f"{metric} could not be measured")
        elif metric == "max_abs_diff" and value > limit:
            failures.append(f"max_abs_diff {value:.3g} > {limit:g}")
        elif metric != "max_abs_diff" and value < limit:
            failures.append(f"{metric} {value:.5f} < {limit:g}")
    return failures
