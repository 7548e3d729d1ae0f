"""Static int8 levers for an exported encoder: do any keep the auto bar, and do they pay?

``.venv/bin/python -m nexus_sli.bench.experiments.int8_levers [REPO] [MODEL]``
(default ``bench/.repo`` and ``all_minilm_l6_v2``) quantizes the fp32 ONNX graph
of ``REPO/MODEL_encoder`` with the levers issue 14 lists, besides the dynamic
int8 and NNCF accuracy control already in ``bench/data/tried.md``:

1. ONNX Runtime static QDQ (``quantize_static``): per-channel int8 weights of the
   36 linear MatMuls, activations uint8 (U8S8: what ORT's x86 kernels fuse into
   MatMulIntegerToFloat; no saturation on VNNI CPUs) or int8 (S8S8, ORT's QDQ
   default), ranges from MinMax, Percentile or Entropy calibration, MatMul
   outputs left fp32 or quantized too;
2. SmoothQuant: NNCF's (OpenVINO IR) for a few alphas, and ONNX Runtime's
   (``extra_options={"SmoothQuant": True}``), which needs neural-compressor 2.x
   (3.x no longer has the ONNX adaptor ORT imports): run this module with an
   interpreter that has it to include that lever, otherwise it says it skipped
   (with neural-compressor 2.6 it fails on this graph: ``bench/data/tried.md``);
3. per-layer mixed precision: for the lever best on the calibration texts and
   their fragments (below), each linear MatMul's sensitivity (those texts' min
   cosine with that MatMul alone kept fp32), then the most sensitive kept fp32
   one by one until those texts' mean cosine is at least the auto bar's and
   their min at least ``--margin`` (:data:`CALIBRATION_MARGIN`).

Calibration uses :data:`CALIBRATION` of the exporter's calibration texts and
never a validation text.  348 of the 372 calibration texts are also bench texts
(both are built from the project's topic sentences), so besides the 635 bench
texts (which contain the 240 validation texts) the figures name the bench
texts *not* calibrated on.  The calibration file has no text under 12 tokens
while the shortest texts suffer most, so choices (the recipe mixed precision
starts from, which MatMuls stay fp32) look at the calibration texts and their
"fragments" (each one's first :data:`FRAGMENT_WORDS` words), never at the
validation or bench texts.  Cosines are to PyTorch fp32 (the packaged model,
pooled as the export does).  Speed is in process, every graph taking turns on
the exporter's timing workloads (:mod:`export.timing`: a batch of 32
mixed-length validation texts, and one short text) beside the fp32 graph and
OpenVINO bf16 (what ``auto`` picked on the CPU this was written on).
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

from nexus_sli.exporter.export.optimize import session
from nexus_sli.exporter.export.source import resolve_model
from nexus_sli.exporter.export.timing import time_side_by_side, workloads
from nexus_sli.exporter.export.validate import AUTO_BAR, validation_texts
from nexus_sli.exporter.targets import TARGETS
from nexus_sli.exporter.targets.cpu import cpu_flags
from nexus_sli.exporter.targets.openvino_cpu import calibration_texts, quantize_int8
from nexus_sli.exporter.triton.python_models.encoding import encode

from ..runners import GraphEncoder, ServedFacts, TorchEncoder
from ..texts import bench_texts
from . import MODEL, bench_repository

#: calibration texts used (evenly spaced over the file: sentences and paragraphs)
CALIBRATION = 160
CALIBRATION_BATCH = 16
#: the min cosine the calibration texts must keep before mixed precision stops adding fp32 MatMuls
CALIBRATION_MARGIN = 0.985
PERCENTILES = (99.99, 99.999)
#: NNCF SmoothQuant alphas for MatMuls; -1 switches SmoothQuant off (NNCF's default is 0.95)
NNCF_ALPHAS = (-1.0, 0.5, 0.75, 0.95)
ORT_SQ_ALPHAS = (0.5, 0.75)
ROUNDS = 9
#: words of a calibration text kept as a short query for choosing fp32 layers (:attr:`Texts.fragments`)
FRAGMENT_WORDS = 3



def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@dataclass(frozen=True)
class Texts:
    """Who calibrates, and who checks."""

    calibration: list[str]
    validation: list[str]
    bench: list[str]

    @classmethod
    def pick(cls, count: int) -> "Texts":
        every = calibration_texts()
        chosen = [every[i] for i in np.linspace(0, len(every) - 1, min(count, len(every))).astype(int)]
        return cls(chosen, validation_texts(), bench_texts())

    @property
    def held_out(self) -> list[str]:
        calibrated = set(self.calibration)
        return [t for t in self.bench if t not in calibrated]

    @property
    def fragments(self) -> list[str]:
        """The first words of each calibration text: the calibration file has no text under 12 tokens,
        while users send 4-8 token queries (``thanks so much!``), which int8 moves most."""
        return [" ".join(text.split()[:FRAGMENT_WORDS]) for text in self.calibration]

    def groups(self) -> dict[str, list[str]]:
        return {"calibration": self.calibration, "fragments": self.fragments, "validation": self.validation,
                "bench": self.bench, "held out": self.held_out}


@dataclass
class Fidelity:
    """Cosine to PyTorch fp32, per text group: (mean, min)."""

    groups: dict[str, tuple[float, float]]
    #: the bench text furthest from PyTorch, and its cosine
    worst: tuple[str, float] = ("", 1.0)

    def passes(self) -> bool:
        # the bench texts contain the validation texts: the bar holds on both when it holds on the bench
        mean, low = self.groups["bench"]
        return mean >= AUTO_BAR["cosine_mean"] and low >= AUTO_BAR["cosine_min"]

    def selection(self) -> tuple[float, float]:
        """(mean, min) over the calibration texts and their fragments: what choices may look at."""
        (mean_c, low_c), (mean_f, low_f) = self.groups["calibration"], self.groups["fragments"]
        return (mean_c + mean_f) / 2, min(low_c, low_f)

    def describe(self) -> str:
        return "; ".join(f"{name} {mean:.5f} / {low:.5f}" for name, (mean, low) in self.groups.items())


class Checker:
    """Embeds every text group with a graph and compares with PyTorch fp32."""

    def __init__(self, facts: ServedFacts, model_dir: Path, texts: Texts):
        self.facts, self.texts = facts, texts
        torch_encoder = TorchEncoder(TorchEncoder.load(model_dir), facts)
        self.reference = {name: _unit(torch_encoder(group)) for name, group in texts.groups().items()}

    def cosines(self, runner, group: str) -> np.ndarray:
        got = _unit(GraphEncoder(runner, self.facts, "candidate")(self.texts.groups()[group]))
        return (got * self.reference[group]).sum(axis=1)

    def fidelity(self, runner) -> Fidelity:
        cosines = {name: self.cosines(runner, name) for name in self.reference}
        worst = int(np.argmin(cosines["bench"]))
        return Fidelity({name: (float(c.mean()), float(c.min())) for name, c in cosines.items()},
                        (self.texts.bench[worst], float(cosines["bench"][worst])))


@dataclass
class Lever:
    """One quantized graph: how it was made, its fidelity, and how to run it."""

    lever: str
    name: str
    path: Path
    open: Callable[[], object]
    fidelity: Fidelity | None = None
    #: the ONNX Runtime static recipe it was made with, if any
    recipe: "StaticRecipe | None" = None
    #: the same recipe with the named MatMuls kept fp32, written to a path: (exclude, path) -> runner
    rebuild: Callable[[list[str], Path], object] | None = None
    timings: dict[str, float] = field(default_factory=dict)


class Calibration:
    """The calibration texts as tokenized batches (shortest first, as length grouping serves them)."""

    def __init__(self, facts: ServedFacts, texts: list[str]):
        tokenizer = facts.tokenizer()
        lengths = [len(e.ids) for e in tokenizer.encode_batch(texts)]
        ordered = [t for _, t in sorted(zip(lengths, texts), key=lambda pair: pair[0])]
        self.feeds = [encode(tokenizer, ordered[i:i + CALIBRATION_BATCH], facts.input_names, facts.pad_id,
                             facts.max_length) for i in range(0, len(ordered), CALIBRATION_BATCH)]

    def reader(self):
        from onnxruntime.quantization import CalibrationDataReader

        feeds = self.feeds

        class Reader(CalibrationDataReader):
            def __init__(self):
                self.items = iter(feeds)

            def get_next(self):
                return next(self.items, None)

            def __len__(self):
                return len(feeds)

            def set_range(self, start_index: int, end_index: int):
                self.items = iter(feeds[start_index:end_index])

        return Reader()


# --- ONNX Runtime static QDQ -------------------------------------------------------------------


def linear_matmuls(path: Path) -> list[str]:
    """MatMuls whose second input is a weight (the linear layers; attention's two are activation x activation)."""
    import onnx

    graph = onnx.load(str(path)).graph
    constants = {i.name for i in graph.initializer}
    constants |= {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    return [n.name for n in graph.node if n.op_type == "MatMul" and n.input[1] in constants]


@dataclass(frozen=True)
class StaticRecipe:
    """One ``quantize_static`` configuration."""

    method: str  # MinMax | Percentile | Entropy
    percentile: float | None = None
    #: uint8 activations (U8S8): with int8 ones ONNX Runtime 1.32's x86 graph optimizer turned only 12 of the
    #: 36 DequantizeLinear -> MatMul pairs into MatMulIntegerToFloat (the rest ran in fp32); with uint8, all 36
    activations: str = "QUInt8"
    #: quantize the MatMul outputs too (ORT then runs QLinearMatMul); otherwise MatMulIntegerToFloat
    quantize_outputs: bool = False
    smooth_quant: float | None = None

    def describe(self) -> str:
        method = f"{self.method} {self.percentile}" if self.percentile else self.method
        extras = [f"activations {self.activations[1:].lower()}", "outputs quantized" if self.quantize_outputs else ""]
        if self.smooth_quant is not None:
            extras.append(f"ORT SmoothQuant alpha {self.smooth_quant}")
        return f"static QDQ, {method}, " + ", ".join(e for e in extras if e)

    def cache_key(self) -> str:
        return f"{self.method}-{self.percentile}-{self.activations}-{self.quantize_outputs}-{self.smooth_quant}"


def quantize_static(source: Path, target: Path, recipe: StaticRecipe, calibration: Calibration,
                    matmuls: list[str], exclude: list[str] = (), cache: Path | None = None) -> Path:
    """``source`` as a QDQ graph: the MatMuls in ``matmuls`` (less ``exclude``) with per-channel int8 weights."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static as ort_static

    # DedicatedQDQPair: ORT fuses a DequantizeLinear into its MatMul only where the MatMul is its one consumer
    # (query, key and value read one tensor)
    extra: dict = {"MatMulConstBOnly": True, "WeightSymmetric": True, "DedicatedQDQPair": True,
                   # percentiles of |x| need the histogram of both signs: LayerNorm outputs are roughly centred
                   "CalibTensorRangeSymmetric": False}
    if recipe.percentile:
        extra["CalibPercentile"] = recipe.percentile
    if recipe.method != "MinMax":
        # ORT's histogram collector stacks a call's batches into one array, which fails on batches of
        # different lengths (the graph cuts each batch's padding): one batch per call instead
        extra["CalibStridedMinMax"] = 1
    if not recipe.quantize_outputs:
        extra["OpTypesToExcludeOutputQuantization"] = ["MatMul"]
    if recipe.smooth_quant is not None:
        extra.update({"SmoothQuant": True, "SmoothQuantAlpha": recipe.smooth_quant})
    ort_static(str(source), str(target), calibration.reader(), quant_format=QuantFormat.QDQ,
               op_types_to_quantize=["MatMul"], per_channel=True,
               activation_type=getattr(QuantType, recipe.activations), weight_type=QuantType.QInt8,
               nodes_to_quantize=[m for m in matmuls if m not in set(exclude)],
               calibrate_method=getattr(CalibrationMethod, recipe.method), extra_options=extra,
               calibration_cache_path=cache)
    return target


def ort_smooth_quant_available() -> str | None:
    """None where ORT's SmoothQuant can run here, else why not."""
    try:
        import neural_compressor.adaptor.ox_utils.smooth_quant  # noqa: F401
    except Exception as exc:  # an absent or incompatible neural-compressor raises anything from its imports
        return f"neural-compressor's ONNX adaptor (2.x) does not import here ({type(exc).__name__}: {exc})"
    return None


# --- NNCF (OpenVINO IR) -----------------------------------------------------------------------


def nncf_int8(source: Path, target: Path, calibration: Calibration, alpha: float, keep: list[str] = ()) -> Path:
    """NNCF static int8 of ``source`` with SmoothQuant at ``alpha`` for MatMuls (-1: off); ``keep`` stays
    fp32.  The exporter's own quantization (:func:`openvino_cpu.quantize_int8`), on these texts."""
    return quantize_int8(source, target, calibration.feeds, list(keep), alpha)


# --- the run ----------------------------------------------------------------------------------


class Run:
    """The fp32 graph, the texts, the reference, and the levers measured so far."""

    def __init__(self, repo: Path, model: str, model_dir: Path, work: Path, count: int):
        self.facts = ServedFacts.read(repo, model)
        self.source = repo / f"{model}_encoder" / "1" / "model.onnx"
        self.work = work
        self.texts = Texts.pick(count)
        self.checker = Checker(self.facts, model_dir, self.texts)
        self.calibration = Calibration(self.facts, self.texts.calibration)
        self.matmuls = linear_matmuls(self.source)
        self.levers: list[Lever] = []
        #: the min cosine the selection texts must reach before mixed precision stops
        self.margin = CALIBRATION_MARGIN

    def add(self, lever: str, name: str, path: Path, rebuild: Callable[[list[str], Path], object],
            recipe: StaticRecipe | None = None) -> Lever:
        """Measure the graph at ``path`` (``rebuild([], path)`` made it) and keep it as a lever."""
        runner = rebuild([], path)
        item = Lever(lever, name, path, lambda: rebuild([], path), recipe=recipe, rebuild=rebuild)
        item.fidelity = self.checker.fidelity(runner)
        self.levers.append(item)
        text, cosine = item.fidelity.worst
        print(f"[{lever}] {name}: cosine mean / min: {item.fidelity.describe()}"
              f"{' (passes the bar)' if item.fidelity.passes() else ''}; worst bench text {text[:60]!r} "
              f"{cosine:.5f}", flush=True)
        return item

    def ort(self, recipe: StaticRecipe, lever: str = "ort static") -> Lever:
        cache = self.work / f"ranges-{recipe.cache_key()}.json"

        def rebuild(exclude: list[str], path: Path):
            if not path.exists():
                quantize_static(self.source, path, recipe, self.calibration, self.matmuls, exclude, cache)
            return session(path)

        return self.add(lever, recipe.describe(), self.work / f"static-{recipe.cache_key()}.onnx", rebuild, recipe)

    def nncf(self, alpha: float) -> Lever:
        ov = TARGETS["openvino"]

        def rebuild(keep: list[str], path: Path):
            if not path.exists():
                nncf_int8(self.source, path, self.calibration, alpha, keep)
            return ov.open(path, ov.serving("int8").parameters)

        label = "SmoothQuant off" if alpha < 0 else f"SmoothQuant alpha {alpha}"
        return self.add("nncf smoothquant", f"NNCF static int8 (OpenVINO), {label}",
                        self.work / f"nncf-sq-{alpha}.xml", rebuild)


def run_ort_static(run: Run) -> None:
    for method, percentile in [("MinMax", None), *[("Percentile", p) for p in PERCENTILES], ("Entropy", None)]:
        run.ort(StaticRecipe(method, percentile))
    base = _best_static(run)
    run.ort(replace(base, activations="QInt8"))
    run.ort(replace(base, quantize_outputs=True))


def run_smooth_quant(run: Run) -> None:
    for alpha in NNCF_ALPHAS:
        run.nncf(alpha)
    why_not = ort_smooth_quant_available()
    if why_not:
        print(f"[ort smoothquant] skipped: {why_not}", flush=True)
        return
    base = _best_static(run)
    for alpha in ORT_SQ_ALPHAS:
        try:
            run.ort(replace(base, smooth_quant=alpha), lever="ort smoothquant")
        except ValueError as exc:
            # neural-compressor 2.6 stacks the calibration batches' activations into one array: batches of
            # different lengths (this graph cuts each batch's padding) make that fail
            print(f"[ort smoothquant] alpha {alpha} failed in neural-compressor: {exc}", flush=True)
            return


def _best(levers: list[Lever]) -> Lever:
    """The lever with the best (min, mean) over the calibration texts and their fragments."""
    return max(levers, key=lambda lever: lever.fidelity.selection()[::-1])


def _best_static(run: Run) -> StaticRecipe:
    """The static recipe best on the calibration texts and fragments (MinMax if none ran).  Only uint8
    activations qualify: int8 ones have the same ranges but ORT runs most of their MatMuls in fp32."""
    statics = [lever for lever in run.levers if lever.recipe is not None
               and lever.recipe.smooth_quant is None and lever.recipe.activations == "QUInt8"]
    return _best(statics).recipe if statics else StaticRecipe("MinMax")


def _selection(run: Run, runner) -> tuple[float, float]:
    cosines = np.concatenate([run.checker.cosines(runner, "calibration"), run.checker.cosines(runner, "fragments")])
    return float(cosines.mean()), float(cosines.min())


def run_mixed(run: Run) -> None:
    """Keep the most sensitive MatMuls of the best lever so far in fp32 until the selection texts clear the margin."""
    if not any(lever.rebuild for lever in run.levers):
        run.ort(_best_static(run))
    # int8 ORT activations tie uint8 ones on fidelity but run mostly in fp32 (see StaticRecipe)
    base = _best([lever for lever in run.levers
                  if lever.rebuild and (lever.recipe is None or lever.recipe.activations == "QUInt8")])
    print(f"[mixed precision] on {base.name}: each of the {len(run.matmuls)} MatMuls alone kept fp32 "
          f"(calibration texts and their fragments, mean / min)", flush=True)
    gains = {}
    for index, node in enumerate(run.matmuls):
        gains[node] = _selection(run, base.rebuild([node], run.work / f"one-{index}{base.path.suffix}"))
        print(f"  {node}: {gains[node][0]:.5f} / {gains[node][1]:.5f}", flush=True)
    kept: list[str] = []
    for node in sorted(gains, key=lambda n: gains[n][::-1], reverse=True):
        kept.append(node)
        mean, low = _selection(run, base.rebuild(kept, run.work / f"mixed-{len(kept)}{base.path.suffix}"))
        print(f"  {len(kept)} kept fp32 (+ {node}): {mean:.5f} / {low:.5f}", flush=True)
        if mean >= AUTO_BAR["cosine_mean"] and low >= run.margin:
            break
    path = run.work / f"mixed-{len(kept)}{base.path.suffix}"
    run.add("mixed precision", f"{base.name}, {len(kept)} of {len(run.matmuls)} MatMuls fp32", path,
            lambda exclude, p: base.rebuild(kept, p))
    print(f"  kept fp32: {', '.join(kept)}", flush=True)


LEVERS = {"ort-static": run_ort_static, "smoothquant": run_smooth_quant, "mixed": run_mixed}


def time_levers(run: Run, rounds: int) -> list[dict[str, float]]:
    """Every lever beside ONNX Runtime fp32 and OpenVINO bf16, taking turns on the exporter's workloads."""
    ov = TARGETS["openvino"]
    facts = run.facts
    loads = workloads(facts.tokenizer(), facts.input_names, facts.pad_id, facts.max_length)
    baselines = [("onnxruntime fp32", lambda: session(run.source))]
    if cpu_flags() & {"avx512_bf16", "amx_bf16"}:
        baselines.append(("openvino bf16", lambda: ov.open(run.source, ov.serving("bf16").parameters)))
    runners = [open_() for _, open_ in baselines] + [lever.open() for lever in run.levers]
    print(f"timing {len(runners)} graphs side by side on {', '.join(load.describe() for load in loads)}, "
          f"{rounds} rounds", flush=True)
    timings = time_side_by_side(runners, loads, rounds)
    for lever, measured in zip(run.levers, timings[len(baselines):]):
        lever.timings = measured
    return [dict(t, name=name) for (name, _), t in zip(baselines, timings[:len(baselines)])]


def report(run: Run, baselines: list[dict]) -> None:
    batch = next(k for k in baselines[0] if k.startswith("batch"))
    fp32 = baselines[0][batch]
    bf16 = baselines[1][batch] if len(baselines) > 1 else None
    print(f"\n| lever | graph | validation + bench mean / min | held out min | calibration + fragments "
          f"mean / min | {batch} ms | vs fp32 | vs OpenVINO bf16 | bar |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for base in baselines:
        versus_bf16 = f"{bf16 / base[batch]:.2f}x" if bf16 else "-"
        print(f"| baseline | {base['name']} | | | | {base[batch]:.1f} | {fp32 / base[batch]:.2f}x | {versus_bf16} | |")
    for lever in run.levers:
        g, ms, (mean, low) = lever.fidelity.groups, lever.timings[batch], lever.fidelity.selection()
        print(f"| {lever.lever} | {lever.name} | {g['bench'][0]:.5f} / {g['bench'][1]:.5f} | "
              f"{g['held out'][1]:.5f} | {mean:.5f} / {low:.5f} | {ms:.1f} | {fp32 / ms:.2f}x | "
              f"{f'{bf16 / ms:.2f}x' if bf16 else '-'} | {'passes' if lever.fidelity.passes() else 'fails'} |")
    short = next(k for k in baselines[0] if not k.startswith("batch"))
    print(f"\n{short} ms: " + ", ".join([f"{b['name']} {b[short]:.2f}" for b in baselines]
                                       + [f"{lever.name} {lever.timings[short]:.2f}" for lever in run.levers]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repo", type=Path, nargs="?", default=bench_repository())
    parser.add_argument("model", nargs="?", default=MODEL)
    parser.add_argument("--model-dir", type=Path, help="the PyTorch checkpoint (default: the packaged MiniLM)")
    parser.add_argument("--levers", default=",".join(LEVERS), help=f"comma-separated, of {', '.join(LEVERS)}")
    parser.add_argument("--calibration", type=int, default=CALIBRATION)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--margin", type=float, default=CALIBRATION_MARGIN,
                        help="min cosine on the calibration texts and fragments that mixed precision stops at")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    flags = " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "amx"))))
    print(f"CPU flags: {flags}", flush=True)
    with tempfile.TemporaryDirectory(prefix="nexus-int8-levers-") as work:
        run = Run(args.repo, args.model, args.model_dir or resolve_model(None).path, Path(work), args.calibration)
        run.margin = args.margin
        fp32 = run.checker.fidelity(session(run.source))
        print(f"texts: {', '.join(f'{k} {len(v)}' for k, v in run.texts.groups().items())}; fp32 graph to "
              f"PyTorch: {fp32.describe()}", flush=True)
        for name in args.levers.split(","):
            LEVERS[name](run)
        report(run, time_levers(run, args.rounds))


if __name__ == "__main__":
    main()
