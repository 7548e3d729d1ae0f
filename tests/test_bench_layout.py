"""Where a bench run of one model keeps its artefacts, and how much it measures.

The packaged default keeps bench/.repo, bench/results and BENCHMARKS.md; any other model
gets folders and a page of its own, derived from ``--model`` alone (bench/layout.py), so
``make bench MODEL=...`` never touches the default's.  The plan is chosen from the model's
size (matmul FLOPs per token, from its config), never its name.  Nothing here exports or
measures: these are the derivations, on names, shapes and synthetic results.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nexus_sli.bench.cli import bench_options
from nexus_sli.bench.compute_limit import EncoderShape, encoder_shape
from nexus_sli.bench.exports import auto_folder, variants
from nexus_sli.bench.layout import layout, short_name
from nexus_sli.bench.repetitions import Repetitions
from nexus_sli.bench.report import TRIED, TRIED_LINK, benchmarks_page, markdown, plan_lines
from nexus_sli.bench.run_size import BASE, BASE_QUICK, FULL, QUICK, choose_run_size, run_size_record
from nexus_sli.cli.main import build_parser

MINILM = EncoderShape(6, 384, 1536)         # all-MiniLM-L6-v2's config
MPNET_BASE = EncoderShape(12, 768, 3072)    # all-mpnet-base-v2's config
LARGE = EncoderShape(24, 1024, 4096)
TEXTS_IN_SET = 635


# --- folders and page ------------------------------------------------------------------------------

@pytest.mark.parametrize("model", [None, "", "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2",
                                   "SENTENCE-TRANSFORMERS/ALL-MINILM-L6-V2"])
def test_the_packaged_default_keeps_the_bench_folders(model):
    where = layout(model)
    assert where.short_name is None
    assert (where.repository, where.results, where.page) == (Path("bench/.repo"), Path("bench/results"),
                                                             Path("BENCHMARKS.md"))
    assert where.quick_results == Path("bench/results/quick") and where.make_command == "make bench"
    assert auto_folder(where.repository) == Path("bench/.repo-auto")


@pytest.mark.parametrize("model", ["all-mpnet-base-v2", "sentence-transformers/all-mpnet-base-v2"])
def test_another_model_gets_folders_and_a_page_of_its_own(model):
    where, default = layout(model), layout(None)
    assert where.short_name == "all-mpnet-base-v2"
    assert where.repository == Path("bench/.repo-all-mpnet-base-v2")
    assert auto_folder(where.repository) == Path("bench/.repo-all-mpnet-base-v2-auto")
    assert where.results == Path("bench/results/all-mpnet-base-v2")
    assert where.out(quick=True) == Path("bench/results/all-mpnet-base-v2/quick")
    assert where.page == Path("BENCHMARKS-all-mpnet-base-v2.md") and where.page.parent == default.page.parent
    assert where.make_command == "make bench MODEL=all-mpnet-base-v2"
    # nothing of the default's: not its repository, auto export, results files, quick folder or page
    # (its results folder holds the default's latest.* files, never inside another model's folder)
    mine = {where.repository, auto_folder(where.repository), where.results, where.quick_results, where.page}
    theirs = {default.repository, auto_folder(default.repository), default.results, default.quick_results,
              default.page}
    assert not mine & theirs
    assert where.results.parent == default.results and where.results != default.quick_results


def test_short_names_of_local_folders_and_hub_ids(tmp_path):
    folder = tmp_path / "My Model (v2)"
    folder.mkdir()
    assert short_name(str(folder)) == "my-model-v2"
    assert short_name(str(folder) + "/") == "my-model-v2"
    assert short_name("BAAI/bge-base-en-v1.5") == "bge-base-en-v1.5"   # a hub id: its last part, never fetched
    assert layout("BAAI/bge-base-en-v1.5").page == Path("BENCHMARKS-bge-base-en-v1.5.md")


def _args(*argv: str):
    return build_parser().parse_args(["bench", *argv])


def test_the_cli_derives_repository_results_and_page_from_the_model():
    options = bench_options(_args("--model", "all-mpnet-base-v2", "--benchmarks-md"))
    assert options.repository == Path("bench/.repo-all-mpnet-base-v2")
    assert options.out == Path("bench/results/all-mpnet-base-v2")
    assert options.benchmarks_md == Path("BENCHMARKS-all-mpnet-base-v2.md")
    assert options.command == "nexus-sli bench --model all-mpnet-base-v2 --benchmarks-md"
    quick = bench_options(_args("--model", "all-mpnet-base-v2", "--quick"))
    assert quick.out == Path("bench/results/all-mpnet-base-v2/quick") and quick.benchmarks_md is None
    # the packaged default: what make bench always wrote, the page included
    default = bench_options(_args("--benchmarks-md"))
    assert (default.repository, default.out, default.benchmarks_md) == (
        Path("bench/.repo"), Path("bench/results"), Path("BENCHMARKS.md"))
    assert bench_options(_args("--quick")).out == Path("bench/results/quick")
    # given paths win, and the page's value is kept as written
    given = bench_options(_args("--model", "all-mpnet-base-v2", "--repo", "r", "--out", "o", "--benchmarks-md", "P.md"))
    assert (given.repository, given.out, given.benchmarks_md) == (Path("r"), Path("o"), Path("P.md"))
    assert given.command.endswith("--benchmarks-md P.md")


# --- the plan, from the model's size ---------------------------------------------------------------

def test_the_plan_is_chosen_from_the_size():
    assert MINILM.flops_per_token() == 6 * 2 * (4 * 384 * 384 + 2 * 384 * 1536)   # 21.2 M
    assert MPNET_BASE.flops_per_token() == pytest.approx(8 * MINILM.flops_per_token())
    assert (choose_run_size(MINILM, quick=False), choose_run_size(MINILM, quick=True)) == (FULL, QUICK)
    assert (choose_run_size(MPNET_BASE, quick=False), choose_run_size(MPNET_BASE, quick=True)) == (BASE, BASE_QUICK)
    assert choose_run_size(LARGE, quick=False) == BASE
    # 12 layers x 384 (all-MiniLM-L12-v2, bge-small) still fits the full plan
    assert choose_run_size(EncoderShape(12, 384, 1536), quick=False) == FULL


def test_a_tiny_mpnet_gets_the_full_plan_its_size_not_its_family(tiny_checkpoint):
    shape = encoder_shape(tiny_checkpoint("mpnet"))
    assert choose_run_size(shape, quick=False) is FULL


def test_the_base_plan_keeps_what_the_targets_read():
    assert BASE.peers and BASE.repetitions >= FULL.repetitions and "grpc" in BASE.protocols
    assert BASE.latency_queries == FULL.latency_queries and BASE.warmup_texts == FULL.warmup_texts
    # fewer texts, still several client batches of 32 in each repetition's slice
    assert BASE.texts < TEXTS_IN_SET and BASE.texts // BASE.repetitions >= 3 * 32
    assert set(BASE.seq_lens) < set(FULL.seq_lens) and len(BASE.seq_lens) >= 3
    assert BASE.max_repetitions >= BASE.repetitions and BASE.repetition_budget_s > 0
    assert not BASE.every_variant and not BASE_QUICK.every_variant and FULL.every_variant and QUICK.every_variant
    # a quick run of a base model is the quick plan with the base plan's configurations
    assert BASE_QUICK.texts == QUICK.texts and BASE_QUICK.peers == QUICK.peers is False


def test_the_base_plan_serves_fp32_and_the_default_only():
    default = {"label": "openvino-int8", "backend": "openvino", "precision": "int8"}
    assert set(variants(default, every=False)) == {"fp32", "openvino-int8"}
    assert variants(default, every=False)["openvino-int8"] == variants(default)["openvino-int8"]
    assert set(variants({"label": "fp32", "backend": "onnxruntime", "precision": "fp32"}, every=False)) == {"fp32"}
    assert set(variants(None, every=False)) == {"fp32"}   # the default unknown: the targets say so
    odd = {"label": "openvino-fp16", "backend": "openvino", "precision": "fp16"}
    assert variants(odd, every=False) == {"fp32": ("onnxruntime", "fp32", ""),
                                          "openvino-fp16": ("openvino", "fp16", "_ov_fp16")}


def test_repetitions_follow_the_plan():
    full = Repetitions.for_run_size(FULL, None, None)
    assert (full.minimum, full.maximum, full.slices, full.budget_s) == (3, 8, 3, 330.0)
    base = Repetitions.for_run_size(BASE, None, None)
    assert (base.minimum, base.maximum, base.slices, base.budget_s) == (3, BASE.max_repetitions, 3,
                                                                        BASE.repetition_budget_s)
    quick = Repetitions.for_run_size(BASE_QUICK, 2, None)
    assert (quick.minimum, quick.maximum, quick.slices) == (2, 2, 1)


def test_the_plan_record_says_what_was_reduced_and_why():
    full = run_size_record(FULL, MINILM, False, TEXTS_IN_SET)
    assert full["name"] == "full" and full["reduced"] == [] and plan_lines(full) == []
    base = run_size_record(BASE, MPNET_BASE, False, TEXTS_IN_SET)
    assert base["name"] == "base" and base["flops_per_token"] == 169_869_312 and not base["warning"]
    assert "170 M matmul FLOPs per token (12 layers x 768 hidden)" in base["why"]
    reduced = " | ".join(base["reduced"])
    for said in (f"{BASE.texts} texts instead of {TEXTS_IN_SET}", "up to 5 and while one more fits in 900 s",
                 "sequence lengths 16, 64, 256", "grpc only", "fp32 and the default configuration only",
                 "no transformers AutoModel rows"):
        assert said in reduced, said
    line = plan_lines(base)[0]
    assert line.startswith("Plan: base, chosen from the model's size") and all(r in line for r in base["reduced"])
    assert "the targets table and the peers are the same" in line
    quick = run_size_record(BASE_QUICK, MPNET_BASE, True, TEXTS_IN_SET)
    assert len(quick["reduced"]) == 1 and "fp32 and the default" in quick["reduced"][0]
    assert "well past an hour" not in quick["why"]
    assert "may take longer than an hour" in run_size_record(BASE, LARGE, False, TEXTS_IN_SET)["warning"]


# --- the page --------------------------------------------------------------------------------------

def _results(model: str | None, plan: dict) -> dict:
    """What benchmarks_page and markdown's header read, for a run of ``model``."""
    return {"model": "sentence-transformers/all-mpnet-base-v2" if model else "sentence-transformers/all-MiniLM-L6-v2",
            "machine": {"cpu_model": "AMD EPYC", "cores": 2, "memory_gb": 24, "flags": {"avx2": True},
                        "load_average_at_start": 0.1},
            "command": "nexus-sli bench" + (f" --model {model}" if model else "") + " --benchmarks-md",
            "settings": {"repetitions": 3, "plan": plan},
            "layout": layout(model).record(page=layout(model).page)}


LATEST = "# nexus-sli bench: x\n\nMachine: m.\n\nCommand: `c`\n\nPlan: base, chosen.\n\n## Targets\n\nrows\n"


def test_another_models_page_names_its_own_folders_and_links_the_default():
    results = _results("all-mpnet-base-v2", run_size_record(BASE, MPNET_BASE, False, TEXTS_IN_SET))
    page = benchmarks_page(results, LATEST)
    assert page.startswith("# Benchmarks: all-mpnet-base-v2\n")
    assert "`make bench MODEL=all-mpnet-base-v2`: sentence-transformers/all-mpnet-base-v2 served" in page
    for path in ("`bench/.repo-all-mpnet-base-v2`", "`bench/results/all-mpnet-base-v2/latest.json`",
                 "`bench/results/all-mpnet-base-v2/quick/`", "`make bench MODEL=all-mpnet-base-v2 QUICK=1`"):
        assert path in page, path
    assert "bench/.repo`" not in page and "`bench/results/latest.json`" not in page
    assert "Plan: base, chosen." in page and "### Targets\n" in page
    # the experiments were made on the packaged model: linked, not carried
    assert "[BENCHMARKS.md](BENCHMARKS.md)" in page and TRIED.read_text().strip() not in page


def test_the_default_page_is_unchanged_in_form():
    page = benchmarks_page(_results(None, run_size_record(FULL, MINILM, False, TEXTS_IN_SET)), LATEST)
    assert page.startswith("# Benchmarks\n") and "The latest figures of `make bench`: the packaged all-MiniLM-L6-v2" in page
    assert "`bench/.repo`" in page and "`bench/results/latest.json`" in page and "`bench/results/quick/`" in page
    assert page.rstrip().endswith(TRIED_LINK.rstrip()) and TRIED.read_text().strip() not in page
    # results written before runs recorded their layout read as the default's
    older = {k: v for k, v in _results(None, {}).items() if k != "layout"}
    assert benchmarks_page(older, LATEST) == benchmarks_page(_results(None, {}), LATEST)


def test_the_latest_page_states_the_plan(tmp_path):
    stored = Path(__file__).resolve().parent.parent / "bench" / "results" / "latest.json"
    results = json.loads(stored.read_text())    # a real full run of the default: its page has no plan line
    assert "Plan: " not in markdown(results)
    results["settings"]["plan"] = run_size_record(BASE, MPNET_BASE, False, TEXTS_IN_SET)
    page = markdown(results)
    assert page.count("Plan: base, chosen from the model's size") == 1
    assert page.index("Command: ") < page.index("Plan: ") < page.index("## Throughput")
