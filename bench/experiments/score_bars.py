"""What each precision reaches against PyTorch fp32 on the scores users compute: the figures the score and
ranking bars (exporter/export/validate.py, AUTO_BAR) are derived from.

For the packaged all-MiniLM-L6-v2 and the tests' seeded retrieval models (a SPLADE SparseEncoder, a native
MultiVectorEncoder, a BGE-M3: built as tests/helpers builds them), every configuration ``auto`` may measure on
a CPU, and the GPU target's fp16 graph (on ONNX Runtime's CPU provider), is validated on every text (no early
stop) and its figures printed: cosines, then per scored output the score error, the rank agreement and, for
sparse outputs, the terms kept and the largest relative weight of a term dropped.

With ``m3-auto`` instead: the seeded BGE-M3 exported with ``auto`` (backend and precision), what it kept and
why, and the kept graph's lexical and ColBERT scores of FlagEmbedding's queries and documents
(``tests/data/bge_m3/flag_reference.json``) against FlagEmbedding's, each error over the query's best score.

An experiment, not part of the product or of ``make bench``; its findings are in bench/data/tried.md,
"Score and ranking bars"::

    NEXUS_SLI_CACHE_DIR=/tmp/nexus-cache-bars .venv/bin/python bench/experiments/score_bars.py /tmp/score_bars.json
    .venv/bin/python bench/experiments/score_bars.py m3-auto
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from conftest import load_tiny_tokenizer  # noqa: E402
from helpers.colbert_models import colbert_folder  # noqa: E402
from helpers.m3_models import build_m3  # noqa: E402
from helpers.task_models import masked_lm, save  # noqa: E402
from helpers.tiny_models import TINY_CONFIGS, build_tiny  # noqa: E402

from nexus_sli.bench.cpu_classes import cpu_class  # noqa: E402
from nexus_sli.bench.machine import machine_info  # noqa: E402
from nexus_sli.exporter.export import pipeline  # noqa: E402
from nexus_sli.exporter.export.source import resolve_model  # noqa: E402
from nexus_sli.exporter.targets import TARGETS, Configuration  # noqa: E402
from nexus_sli.exporter.targets.registry import AUTO_CONFIGURATIONS  # noqa: E402

#: every configuration auto measures on a CPU, then the GPU target's
CONFIGURATIONS = (*AUTO_CONFIGURATIONS["cpu"], *AUTO_CONFIGURATIONS["gpu"])
#: the faithful precisions only, for the tests' tiny family checkpoints (the GPU target's auto has only fp16)
FAITHFUL = (("openvino", "bf16"), *AUTO_CONFIGURATIONS["gpu"])


def splade_folder(root: Path, tokenizer) -> Path:
    """The seeded BERT masked-LM as a SparseEncoder folder (tests/test_sparse.py's ``bert_splade``)."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    bert = save(masked_lm("bert", 11), tokenizer, root / "bert_mlm")
    folder = root / "bert_splade"
    SparseEncoder(modules=[Transformer(str(bert), transformer_task="fill-mask"), SpladePooling("max")],
                  device="cpu").save(str(folder))
    return folder


def models(root: Path) -> dict[str, str | None]:
    tokenizer = load_tiny_tokenizer()
    return {"all-MiniLM-L6-v2 (packaged)": None,
            "seeded SPLADE (bert)": str(splade_folder(root, tokenizer)),
            "seeded ColBERT (native)": str(colbert_folder(root / "colbert", "native", expansion_length=12)),
            "seeded BGE-M3": str(build_m3(root / "bge-m3", tokenizer))}


def tiny_families(root: Path) -> dict[str, str]:
    """Every family's seeded tiny checkpoint (tests/helpers/tiny_models.py), exported for embeddings."""
    tokenizer = load_tiny_tokenizer()
    return {f"tiny {family}": str(build_tiny(family, root / family, tokenizer)) for family in TINY_CONFIGS}


def measure(model: str | None, work: Path, configurations=CONFIGURATIONS, task: str = "auto") -> list[dict]:
    """Every configuration's candidates on ``model``, validated on every text."""
    options = pipeline.ExportOptions(model=model, task=task, allow_pickle=True, cache=False)
    prepared = pipeline.prepare(options, resolve_model(model, True), work)
    flags = {flag for flag, present in machine_info()["flags"].items() if present}
    rows = []
    for backend, precision in configurations:
        target = TARGETS[backend]
        if not target.suits(precision, flags):
            continue
        configuration = Configuration(target, precision, "score bars experiment", auto=True)
        for candidate in pipeline.try_configuration(configuration, prepared, stop_early=False).candidates:
            report = candidate.report
            rows.append({"backend": backend, "precision": precision, "graph": candidate.graph,
                         "passed": report.passed, "cosine_min": report.cosine_min, "cosine_mean": report.cosine_mean,
                         "scores": {name: figures.to_dict() for name, figures in report.scores.items()},
                         "failures": [str(f) for f in report.failures]})
    return rows


def m3_auto_against_flag() -> None:
    """The seeded BGE-M3's ``auto`` export, and its kept graph's scores against FlagEmbedding's."""
    import numpy as np

    from nexus_sli.client.late_interaction import lexical_score, maxsim
    from nexus_sli.exporter.triton import config as tc
    from nexus_sli.tasks import bge_m3
    from nexus_sli.tasks.model_parameters import message_strings

    flag = json.loads((Path(__file__).resolve().parents[2] / "tests/data/bge_m3/flag_reference.json").read_text())
    with tempfile.TemporaryDirectory() as scratch:
        folder = build_m3(Path(scratch) / "bge-m3", load_tiny_tokenizer())
        out = Path(scratch) / "repo"
        report = pipeline.run_export(pipeline.ExportOptions(model=str(folder), name="m3", out=out, backend="auto",
                                                            precision="auto", allow_pickle=True, cache=False)).report
        print(f"kept {report.kept_because}")
        for row in report.measured:
            print(f"  {row.backend:12s} {row.precision:5s} {row.graph:40s} passed {row.passed!s:5s} score error "
                  f"{row.score_error} rank {row.rank_agreement} terms kept {row.terms_kept} {row.timings_ms}")
        encoder = out / "m3_encoder"
        config = tc.read(encoder / "config.pbtxt")
        graph = TARGETS[report.validation.backend].open(encoder / "1" / config.default_model_filename,
                                                        message_strings(config.parameters))
        answers = {side: _m3_answers(graph, flag[side]["input_ids"], bge_m3) for side in ("queries", "documents")}
    lexical = lexical_score([a[0] for a in answers["queries"]], [a[0] for a in answers["documents"]])
    colbert = maxsim([a[1] for a in answers["queries"]], [a[1] for a in answers["documents"]], mean=True)
    for name, ours, theirs in (("lexical", lexical, flag["lexical_scores"]), ("ColBERT", colbert, flag["colbert_scores"])):
        theirs = np.asarray(theirs)
        errors = np.abs(ours - theirs).max(axis=1) / np.abs(theirs).max(axis=1)
        print(f"{name} scores against FlagEmbedding's: error over each query's best score, max {errors.max():.3g}; "
              f"same order per query: {all((np.argsort(-o) == np.argsort(-t)).all() for o, t in zip(ours, theirs))}")


def _m3_answers(graph, texts_ids: list[list[int]], bge_m3) -> list:
    """Each text's ({id: weight}, ColBERT vectors) from the graph, one text a run (no padding)."""
    import numpy as np

    answers = []
    for ids in texts_ids:
        ids = np.asarray([ids], np.int64)
        mask = np.ones_like(ids)
        score = mask.copy()
        score[:, 0] = 0  # FlagEmbedding drops the first token's ColBERT vector
        feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids), "score_mask": score}
        names = [i.name for i in graph.get_inputs()]
        _, weights, vectors = graph.run(None, {name: feeds[name] for name in names})
        found, values = bge_m3.lexical(weights[0], ids[0])
        answers.append((dict(zip(found.tolist(), values.tolist())), vectors[0][score[0, :vectors.shape[1]] == 1]))
    return answers


def main() -> None:
    if sys.argv[1:] == ["m3-auto"]:
        return m3_auto_against_flag()
    logging.basicConfig(level=logging.WARNING)
    info = machine_info()
    found = {"machine": {"cpu": info["cpu_model"], "class": cpu_class(info["flags"]), "cores": info["usable_cores"]},
             "models": {}}
    print(f"{info['cpu_model']}, class {found['machine']['class']}, {info['usable_cores']} cores")
    only = sys.argv[2:]  # words of the names of the models to run (default: all)
    with tempfile.TemporaryDirectory() as scratch:
        runs = [(name, model, CONFIGURATIONS, "auto") for name, model in models(Path(scratch) / "models").items()]
        runs += [(name, model, FAITHFUL, "embedding") for name, model in tiny_families(Path(scratch) / "tiny").items()]
        for name, model, configurations, task in runs:
            if only and not any(word in name for word in only):
                continue
            work = Path(scratch) / name.replace(" ", "_")
            work.mkdir()
            found["models"][name] = rows = measure(model, work, configurations, task)
            print(f"\n{name}")
            for row in rows:
                cosines = (f"cos min {row['cosine_min']:.5f} mean {row['cosine_mean']:.5f}"
                           if row["cosine_min"] is not None else "")
                print(f"  {row['backend']:21s} {row['precision']:5s} {row['graph']:28s} {cosines}"
                      f"{'' if row['passed'] else '  FAILED: ' + ' | '.join(row['failures'])[:300]}")
                for output, f in row["scores"].items():
                    terms = (f"  terms kept {f['terms_kept']:.4f} of {f['terms']}, dropped max {f['dropped_max']:.3g}"
                             if f["terms"] is not None else "")
                    rank = "-" if f["rank_agreement"] is None else f"{f['rank_agreement']:.5f}"
                    print(f"      {output:16s} {f['similarity']:10s} error max {f['score_error']:.3g} mean "
                          f"{f['score_error_mean']:.3g}  rank {rank} ({f['ranked']} pairs, {f['ties']} ties){terms}")
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    main()
