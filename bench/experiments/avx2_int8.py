"""Faithful int8 on CPUs without VNNI (issue 24, item 1): which ONNX Runtime int8 keeps the auto bar, and pays?

``.venv/bin/python -m nexus_sli.bench.experiments.avx2_int8 [--model M] [--runs N] [--variants ...]``

Without VNNI, ONNX Runtime's x86 u8 x s8 integer kernels multiply with
``vpmaddubsw``, which adds two u8 x s8 products into a saturating 16-bit sum;
7-bit weights (``reduce_range``) or u8 x u8 (``weight_type=QUInt8``, whose AVX2
kernel widens to 16 bits first) avoid the saturation.  This script builds the
plain and fused fp32 graphs the way the exporter does (the pipeline's own
preparation and the ONNX Runtime target's fusion), quantizes them with every
combination of those levers, per-channel or per-tensor weights, weight-only
``MatMulNBits`` with int8 compute, and keeps chosen MatMuls in fp32:

* role-based: the feed-forward output projections, the attention output
  projections, or both (the exporter's helpers find them);
* sensitivity-based: each linear MatMul alone kept fp32, measured on the
  CALIBRATION texts (the exporter's calibration file less any validation text,
  plus each one's first words as a short query), then the most sensitive kept
  fp32 one by one until those texts clear the auto bar's mean and
  :data:`CALIBRATION_MIN`.  The calibration reference is the fp32 graph
  (which matches PyTorch to ~1e-7): choices never look at the validation texts.

Every variant is then judged as ``auto`` judges it: the pipeline's
``validate.compare`` on the 240 validation texts against PyTorch fp32, with the
int8 limits tightened to the auto bar; and timed side by side with ONNX Runtime
fp32 (plain and fused) on the exporter's workloads (a batch of 32, one short
text), the graphs taking turns (``timing.time_side_by_side``), ``--runs`` times.
Ratios are fp32 plain's median over the variant's (above 1: faster).

The ``MatMulNBits`` recipes use ONNX Runtime's ``MatMulNBitsQuantizer``, which
imports ``onnx_ir`` (not a project dependency): install it beside the venv,
``.venv/bin/pip install --target /tmp/onnxir_pkgs --no-deps onnx_ir``, and run
with ``PYTHONPATH=/tmp/onnxir_pkgs``.  Findings: ``bench/data/tried.md``,
"Faithful int8 on AVX2 without VNNI".
"""

from __future__ import annotations

import argparse
import datetime
import logging
import platform
import statistics
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from nexus_sli.exporter.export import pipeline
from nexus_sli.exporter.export.optimize import session
from nexus_sli.exporter.export.quantize import Int8Config, quantize_int8
from nexus_sli.exporter.export.timing import time_side_by_side
from nexus_sli.exporter.export.validate import AUTO_BAR, compare, thresholds, validation_texts, with_auto_bar
from nexus_sli.exporter.targets.cpu import cpu_flags
from nexus_sli.exporter.targets.onnxruntime_cpu import OnnxRuntimeCPU
from nexus_sli.exporter.targets.openvino_cpu import calibration_texts
from nexus_sli.exporter.triton.python_models.encoding import encode, l2_normalize

#: the min cosine the calibration texts (and their fragments) must reach before mixed precision stops
CALIBRATION_MIN = 0.985
CALIBRATION_BATCH = 16
FRAGMENT_WORDS = 3
#: most MatMuls the sensitivity search keeps in fp32 before giving up
MAX_KEPT = 12


@dataclass(frozen=True)
class Recipe:
    """One way to make int8: ONNX Runtime dynamic (``Int8Config``) or weight-only MatMulNBits."""

    name: str
    dynamic: Int8Config | None = None
    nbits: int = 0
    block: int = 32
    accuracy_level: int = 4

    def quantize(self, source: Path, target: Path, exclude: list[str]) -> Path:
        if self.dynamic is not None:
            return quantize_int8(source, target, exclude, self.dynamic)
        return _matmul_nbits(source, target, exclude, self.nbits, self.block, self.accuracy_level)


def _matmul_nbits(source: Path, target: Path, exclude: list[str], bits: int, block: int, level: int) -> Path:
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(onnx.load(str(source)), bits=bits, block_size=block, is_symmetric=True,
                                     accuracy_level=level, nodes_to_exclude=list(exclude))
    quantizer.process()
    quantizer.model.save_model_to_file(str(target), False)
    return target


def _dyn(name: str, **fields) -> Recipe:
    return Recipe(name, dynamic=Int8Config(**fields))


RECIPES = {r.name: r for r in [
    _dyn("s8 per-channel (exporter)", per_channel=True, weight_type="QInt8", reduce_range=False),
    _dyn("s8 per-channel 7-bit", per_channel=True, weight_type="QInt8", reduce_range=True),
    _dyn("s8 per-tensor", per_channel=False, weight_type="QInt8", reduce_range=False),
    _dyn("s8 per-tensor 7-bit", per_channel=False, weight_type="QInt8", reduce_range=True),
    _dyn("u8 per-channel", per_channel=True, weight_type="QUInt8", reduce_range=False),
    _dyn("u8 per-channel 7-bit", per_channel=True, weight_type="QUInt8", reduce_range=True),
    _dyn("u8 per-tensor", per_channel=False, weight_type="QUInt8", reduce_range=False),
    _dyn("u8 per-tensor 7-bit", per_channel=False, weight_type="QUInt8", reduce_range=True),
    *[Recipe(f"MatMulNBits 8-bit b{b} int8-compute", nbits=8, block=b, accuracy_level=4) for b in (32, 64, 128, 256)],
    Recipe("MatMulNBits 4-bit b32 int8-compute", nbits=4, block=32, accuracy_level=4),
]}


@dataclass
class Variant:
    graph: str  # plain | fused
    recipe: Recipe
    keep: str  # what stays fp32
    exclude: list[str]
    path: Path | None = None
    cosine_mean: float = float("nan")
    cosine_min: float = float("nan")
    passed: bool = False
    calibration: tuple[float, float] = (float("nan"), float("nan"))
    timings: list[dict[str, float]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.graph}, {self.recipe.name}, fp32: {self.keep}"


def linear_matmuls(path: Path) -> list[str]:
    """MatMuls with a weight as second input (attention's score products multiply two activations), and
    fused Attention nodes (their query/key/value projection is quantized with them)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    weights = {i.name for i in graph.initializer}
    return [n.name for n in graph.node
            if (n.op_type == "MatMul" and n.input[1] in weights) or n.op_type == "Attention"]


class Study:
    """The exporter's prepared export (plain graph, PyTorch reference, workloads) and the variants made from it."""

    def __init__(self, model: str | None, work: Path):
        options = pipeline.ExportOptions(model=model, precision="int8", backend="onnxruntime", out=work / "repo")
        source = pipeline.resolve_model(options.model)
        self.model_id = source.model_id
        (work / "prep").mkdir(parents=True, exist_ok=True)
        self.prepared = pipeline._prepare(options, source, work / "prep")
        self.graph = replace(self.prepared.graph, work=work / "graphs")
        self.graph.work.mkdir(exist_ok=True)
        self.limits = with_auto_bar(thresholds(self.prepared.task, "int8"), self.prepared.task)
        fused = OnnxRuntimeCPU()._fused(self.graph)
        self.sources = {"plain": self.graph.plain, **{c.graph: c.path for c in fused}}
        self.fp32 = {name: self.graph.trimmed(path) for name, path in self.sources.items()}
        self._calibration_feeds()

    # --- fidelity -------------------------------------------------------------------------
    def validate(self, path: Path) -> tuple[float, float, bool]:
        """What ``auto`` sees: the pipeline's comparison on the validation texts, at the auto bar."""
        graph = self.graph
        pooled, tokens = (*graph.pooling.outputs, None)[:2] if graph.pooled else (None, None)
        report = compare(session(path), self.prepared.reference, "int8", self.prepared.embedder,
                         self.prepared.task, "onnxruntime", self.limits, True, pooled=pooled, tokens=tokens)
        return report.cosine_mean, report.cosine_min, report.passed

    def _calibration_feeds(self) -> None:
        held = set(validation_texts())
        texts = [t for t in calibration_texts() if t not in held]
        texts += [" ".join(t.split()[:FRAGMENT_WORDS]) for t in texts]
        tok, g = self.graph.tokenizer, self.graph
        lengths = [len(e.ids) for e in tok.encode_batch(texts)]
        ordered = [t for _, t in sorted(zip(lengths, texts), key=lambda p: p[0])]
        self.calibration_count = len(ordered)
        self.calibration = [encode(tok, ordered[i:i + CALIBRATION_BATCH], g.input_names, g.pad_id, g.max_length)
                            for i in range(0, len(ordered), CALIBRATION_BATCH)]
        reference = session(self.fp32["plain"])
        self.calibration_reference = self._embed(reference)

    def _embed(self, runner) -> np.ndarray:
        if not self.graph.pooled:
            raise SystemExit("this study expects an embedding model whose graph pools")
        return np.concatenate([l2_normalize(runner.run(None, feeds)[0].astype(np.float64))
                               for feeds in self.calibration])

    def calibrate(self, path: Path) -> tuple[float, float]:
        """(mean, min) cosine on the calibration texts and fragments, to the fp32 graph."""
        cosines = (self._embed(session(path)) * self.calibration_reference).sum(axis=1)
        return float(cosines.mean()), float(cosines.min())

    # --- making variants -------------------------------------------------------------------
    def make(self, variant: Variant) -> Variant:
        stem = f"{variant.graph}-{abs(hash((variant.recipe.name, tuple(variant.exclude)))):x}"
        raw = variant.recipe.quantize(self.sources[variant.graph], self.graph.work / f"{stem}.onnx",
                                      variant.exclude)
        variant.path = self.graph.trimmed(raw)
        variant.cosine_mean, variant.cosine_min, variant.passed = self.validate(variant.path)
        variant.calibration = self.calibrate(variant.path)
        print(f"  {variant.label}: validation mean {variant.cosine_mean:.5f} min {variant.cosine_min:.5f}"
              f" ({'passes' if variant.passed else 'fails'}); calibration {variant.calibration[0]:.5f} / "
              f"{variant.calibration[1]:.5f}", flush=True)
        return variant

    def roles(self, graph: str) -> dict[str, list[str]]:
        path = self.sources[graph]
        ffn, attn = self.graph.ffn_outputs(path), self.graph.attention_outputs(path)
        return {"none": [], "ffn out": ffn, "attn out": attn, "ffn+attn out": ffn + attn}

    def sensitive(self, graph: str, recipe: Recipe) -> Variant:
        """Keep the MatMuls that cost the calibration texts most in fp32, until they clear the bar."""
        matmuls = linear_matmuls(self.sources[graph])
        gains = {}
        for node in matmuls:
            raw = recipe.quantize(self.sources[graph], self.graph.work / "one.onnx", [node])
            gains[node] = self.calibrate(self.graph.trimmed(raw))
        kept: list[str] = []
        for node in sorted(gains, key=lambda n: gains[n][::-1], reverse=True)[:MAX_KEPT]:
            kept.append(node)
            raw = recipe.quantize(self.sources[graph], self.graph.work / "some.onnx", kept)
            mean, low = self.calibrate(self.graph.trimmed(raw))
            print(f"    {len(kept)} fp32 (+{node}): calibration {mean:.5f} / {low:.5f}", flush=True)
            if mean >= AUTO_BAR["cosine_mean"] and low >= CALIBRATION_MIN:
                break
        return Variant(graph, recipe, f"{len(kept)} of {len(matmuls)} most sensitive", kept)


def _time(study: Study, variants: list[Variant], runs: int, rounds: int) -> list[dict[str, float]]:
    """``runs`` side-by-side timings of fp32 (plain, fused) and the variants; returns fp32's per run."""
    loads = study.prepared.workloads
    baselines: list[list[dict[str, float]]] = [[] for _ in study.fp32]
    for run in range(runs):
        runners = [session(p) for p in study.fp32.values()] + [session(v.path) for v in variants]
        measured = time_side_by_side(runners, loads, rounds)
        for i, m in enumerate(measured[:len(study.fp32)]):
            baselines[i].append(m)
        for variant, m in zip(variants, measured[len(study.fp32):]):
            variant.timings.append(m)
        del runners
        print(f"  timing run {run + 1} of {runs} done", flush=True)
    return baselines


def _ratios(study: Study, fp32: list[dict[str, float]], timings: list[dict[str, float]]) -> dict[str, list[float]]:
    """Per run: fp32 plain's median over this graph's (batch, single), and the balanced objective's
    score ratio (geometric mean of the two)."""
    batch, single = (load.name for load in study.prepared.workloads)
    out = {"batch": [], "single": [], "balanced": []}
    for base, t in zip(fp32, timings):
        b, s = base[batch] / t[batch], base[single] / t[single]
        out["batch"].append(b)
        out["single"].append(s)
        out["balanced"].append(float(np.sqrt(b * s)))
    return out


def _fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def report(study: Study, variants: list[Variant], fp32_runs: list[list[dict[str, float]]]) -> None:
    batch, single = (load.name for load in study.prepared.workloads)
    plain = fp32_runs[0]
    print(f"\n| graph | int8 recipe | kept fp32 | validation mean / min | auto bar | calibration mean / min "
          f"| batch ms | single ms | batch vs fp32 | single vs fp32 | balanced vs fp32 |")
    print("|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for name, runs in zip(study.fp32, fp32_runs):
        r = _ratios(study, plain, runs)
        print(f"| {name} | fp32 | all | 1 / 1 | | | {statistics.median(t[batch] for t in runs):.1f} | "
              f"{statistics.median(t[single] for t in runs):.2f} | {_fmt(r['batch'])} | {_fmt(r['single'])} | "
              f"{_fmt(r['balanced'])} |")
    for v in variants:
        r = _ratios(study, plain, v.timings)
        print(f"| {v.graph} | {v.recipe.name} | {v.keep} ({len(v.exclude)}) | {v.cosine_mean:.5f} / "
              f"{v.cosine_min:.5f} | {'passes' if v.passed else 'fails'} | {v.calibration[0]:.5f} / "
              f"{v.calibration[1]:.5f} | {statistics.median(t[batch] for t in v.timings):.1f} | "
              f"{statistics.median(t[single] for t in v.timings):.2f} | {_fmt(r['batch'])} | "
              f"{_fmt(r['single'])} | {_fmt(r['balanced'])} |")
    print(f"\nworkloads: {', '.join(load.describe() for load in study.prepared.workloads)}; ratios: median "
          f"(range) over {len(plain)} side-by-side runs, fp32 plain's median / the graph's")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model id or folder (default: the packaged MiniLM)")
    parser.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated names of RECIPES")
    parser.add_argument("--graphs", default="plain,fused")
    parser.add_argument("--roles", default="none,ffn out,attn out,ffn+attn out")
    parser.add_argument("--sensitive", default="", help="recipe names to run the sensitivity search for")
    parser.add_argument("--time", default="passing", choices=["all", "passing", "none"],
                        help="which variants to time beside fp32")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    flags = " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c"))))
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {platform.processor() or ''} "
          f"CPU flags: {flags}", flush=True)
    with tempfile.TemporaryDirectory(prefix="nexus-avx2-int8-") as work:
        study = Study(args.model, Path(work))
        print(f"{study.model_id}: graphs {', '.join(study.sources)}; {study.calibration_count} calibration "
              f"texts and fragments (no validation text); limits {study.limits}", flush=True)
        variants: list[Variant] = []
        for graph in [g for g in args.graphs.split(",") if g in study.sources]:
            roles = study.roles(graph)
            for recipe in [RECIPES[r] for r in args.recipes.split(",") if r]:
                for role in args.roles.split(","):
                    if role in roles and (role == "none" or roles[role]):
                        variants.append(study.make(Variant(graph, recipe, role, roles[role])))
            for name in [r for r in args.sensitive.split(",") if r]:
                print(f"  sensitivity search: {graph}, {name}", flush=True)
                variants.append(study.make(study.sensitive(graph, RECIPES[name])))
        timed = [v for v in variants if args.time == "all" or (args.time == "passing" and v.passed)]
        if args.time != "none":
            print(f"timing fp32 and {len(timed)} variants side by side, {args.runs} runs", flush=True)
            fp32_runs = _time(study, timed, args.runs, args.rounds)
            report(study, timed, fp32_runs)
        untimed = [v for v in variants if v not in timed]
        if untimed:
            print("\nnot timed: " + "; ".join(f"{v.label} {v.cosine_mean:.5f} / {v.cosine_min:.5f}"
                                              for v in untimed))


if __name__ == "__main__":
    main()
