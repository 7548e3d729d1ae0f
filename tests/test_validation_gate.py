"""The validation gate against deliberately wrong graphs.

A tiny seeded model per task is exported to ONNX once; each test edits that graph in a small, known way
(an output scaled, its rows or labels reversed, NaN on padded or real positions, two outputs swapped) and
asserts that validation against PyTorch refuses it, at fp32 and at a reduced precision, while the unedited
graph passes: a gate that refuses everything would prove nothing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from nexus_sli.exporter.export.onnx_export import export_onnx, model_input_names
from nexus_sli.exporter.export.padding_trim import add_padding_trim
from nexus_sli.exporter.export.pooling import add_pooling
from nexus_sli.exporter.export.report import AgreementShortfall, FidelityShortfall, ScoreShortfall, ValueMismatch
from nexus_sli.exporter.export.validate import Embedder, build_reference, compare, parity_cases
from nexus_sli.tasks import get_task
from helpers.tiny_models import COMMON, VOCAB, padded_feeds, quiet_session

#: the tasks whose graphs are edited here: (task, transformers config overrides)
TASKS = {"embedding": {}, "classification": {"num_labels": 3}, "token-classification": {"num_labels": 5},
         "question-answering": {"num_labels": 2}, "rerank": {"num_labels": 1}}
#: the text batches: rows of different lengths, padded past the longest as the served tokenizer pads
TEXT_LENGTHS, TEXT_WIDTH = [(12, 3, 9, 1, 7, 12, 5, 2), (6, 6, 4, 11, 2, 8, 10, 3)], 14
EMBEDDER = Embedder("mean", True)
_EDIT = "gate/"


@pytest.fixture(scope="module")
def graphs(tmp_path_factory) -> dict[str, dict]:
    """Per task: its seeded tiny model's plain graph, and PyTorch's reference on the parity cases and texts."""
    from transformers import BertConfig

    folder = tmp_path_factory.mktemp("gate")
    made = {}
    for number, (name, overrides) in enumerate(TASKS.items()):
        task = get_task(name)
        torch.manual_seed(number)
        model = task.build(BertConfig(**COMMON, **overrides)).eval()
        head = getattr(model, "classifier", None) or getattr(model, "qa_outputs", None)
        if head is not None:  # random logits sit close together: spread them so that they decide
            with torch.no_grad():
                head.weight.mul_(100)
        names = model_input_names(model, model.config)
        path = folder / f"{name}.onnx"
        export_onnx(model, task, names, VOCAB, path)
        texts = [{n: padded_feeds(list(lengths), TEXT_WIDTH, seed=seed)[n] for n in names}
                 for seed, lengths in enumerate(TEXT_LENGTHS)]
        reference = build_reference(model, task, names, parity_cases(names, VOCAB, 0, 64), texts)
        made[name] = {"task": task, "path": path, "reference": reference, "folder": folder}
    return made


def _judge(graph: dict, path: Path, precision: str, **options):
    embedder = EMBEDDER if graph["task"].name == "embedding" else None
    return compare(quiet_session(path), graph["reference"], precision, embedder, graph["task"],
                   trims_padding=options.pop("trims_padding", False), **options)


def _edited(source: Path, target: Path, output: str, nodes) -> Path:
    """``source`` with ``output`` made by ``nodes(raw)`` from what the graph made of it (renamed ``raw``)."""
    model = onnx.load(str(source))
    raw = _EDIT + output + "/raw"
    for node in model.graph.node:
        node.output[:] = [raw if name == output else name for name in node.output]
        node.input[:] = [raw if name == output else name for name in node.input]
    made, constants = nodes(raw)
    made[-1].output[:] = [output]
    model.graph.node.extend(made)
    model.graph.initializer.extend(constants)
    onnx.save(model, str(target))
    return target


def _constant(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value), _EDIT + name)


def scaled(factor: float):
    return lambda raw: ([helper.make_node("Mul", [raw, _EDIT + "factor"], ["out"])],
                        [_constant("factor", np.float32(factor))])


def reversed_along(axis: int):
    """The output read backwards along ``axis`` (0: rows swapped, -1: labels in the opposite order)."""
    def nodes(raw):
        limits = [_constant("start", [-1]), _constant("end", [np.iinfo(np.int64).min]),
                  _constant("axis", [axis]), _constant("step", [-1])]
        return [helper.make_node("Slice", [raw, *(_EDIT + n for n in ("start", "end", "axis", "step"))],
                                 ["out"])], limits
    return nodes


def nan_where(condition, rank: int, per_token: bool = True):
    """NaN wherever ``condition`` (nodes reading the graph's inputs, ending in ``[batch, sequence]`` booleans
    named ``gate/where``) holds, the output unchanged elsewhere; ``rank``: the output's rank; an output with no
    sequence axis (``per_token`` false) is NaN on each row where the condition holds anywhere."""
    def nodes(raw):
        made, constants = condition()
        where = _EDIT + "where"
        if not per_token:
            made += [helper.make_node("Cast", [where], [_EDIT + "where_i"], to=TensorProto.INT64),
                     helper.make_node("ReduceMax", [_EDIT + "where_i"], [_EDIT + "row_i"], axes=[1], keepdims=1),
                     helper.make_node("Cast", [_EDIT + "row_i"], [_EDIT + "row"], to=TensorProto.BOOL)]
            where = _EDIT + "row"
        elif rank == 3:
            made.append(helper.make_node("Unsqueeze", [where, _EDIT + "last"], [_EDIT + "where3"]))
            constants.append(_constant("last", [2]))
            where = _EDIT + "where3"
        made.append(helper.make_node("Where", [where, _EDIT + "nan", raw], ["out"]))
        return made, [*constants, _constant("nan", np.float32(np.nan))]
    return nodes


def padding():
    """The positions the attention mask leaves out."""
    return [helper.make_node("Cast", ["attention_mask"], [_EDIT + "held"], to=TensorProto.BOOL),
            helper.make_node("Not", [_EDIT + "held"], [_EDIT + "where"])], []


def token(token_id: int):
    """The positions holding ``token_id``: real tokens of the texts."""
    return lambda: ([helper.make_node("Equal", ["input_ids", _EDIT + "id"], [_EDIT + "where"])],
                    [_constant("id", np.array(token_id, np.int64))])


def _kinds(report) -> set[type]:
    return {type(failure) for failure in report.failures}


def test_the_unedited_graphs_pass_so_each_refusal_below_is_the_edits(graphs):
    for name, graph in graphs.items():
        for precision in ("fp32", "int8"):
            report = _judge(graph, graph["path"], precision)
            assert report.passed, (name, precision, report.summary())


@pytest.mark.parametrize("name", list(TASKS))
def test_an_output_scaled_by_a_thousandth_fails_fp32_parity(graphs, name):
    graph = graphs[name]
    output = graph["task"].output_names()[0]
    path = _edited(graph["path"], graph["folder"] / f"{name}-scaled.onnx", output, scaled(1.001))
    assert ValueMismatch in _kinds(_judge(graph, path, "fp32"))


@pytest.mark.parametrize("name", list(TASKS))
def test_rows_in_the_wrong_order_fail_at_every_precision(graphs, name):
    graph = graphs[name]
    output = graph["task"].output_names()[0]
    path = _edited(graph["path"], graph["folder"] / f"{name}-rows.onnx", output, reversed_along(0))
    assert ValueMismatch in _kinds(_judge(graph, path, "fp32"))
    assert _kinds(_judge(graph, path, "int8")) & {FidelityShortfall, AgreementShortfall}


@pytest.mark.parametrize("name", ["classification", "token-classification"])
def test_labels_in_the_opposite_order_fail_at_every_precision(graphs, name):
    graph = graphs[name]
    path = _edited(graph["path"], graph["folder"] / f"{name}-labels.onnx", "logits", reversed_along(-1))
    assert ValueMismatch in _kinds(_judge(graph, path, "fp32"))
    assert AgreementShortfall in _kinds(_judge(graph, path, "int8"))


def test_start_and_end_swapped_fail_at_every_precision(graphs):
    graph = graphs["question-answering"]
    model = onnx.load(str(graph["path"]))
    swap = {"start_logits": "end_logits", "end_logits": "start_logits"}
    for node in model.graph.node:
        node.output[:] = [swap.get(name, name) for name in node.output]
    path = graph["folder"] / "qa-swapped.onnx"
    onnx.save(model, str(path))
    assert ValueMismatch in _kinds(_judge(graph, path, "fp32"))
    assert AgreementShortfall in _kinds(_judge(graph, path, "int8"))


@pytest.mark.parametrize("precision", ["fp32", "int8", "bf16"])
@pytest.mark.parametrize("name", list(TASKS))
def test_nan_on_real_tokens_fails_at_every_precision(graphs, name, precision):
    """A NaN compares false with every bar: it must fail as a value, not pass as no difference."""
    graph = graphs[name]
    task = graph["task"]
    ids = graph["reference"].batches[-1]["input_ids"]
    output = task.output_names()[0]
    rank = graph["reference"].outputs[0][0].ndim
    poison = nan_where(token(int(ids[0, 0])), rank, task.per_token)
    path = _edited(graph["path"], graph["folder"] / f"{name}-nan.onnx", output, poison)
    report = _judge(graph, path, precision)
    assert ValueMismatch in _kinds(report), report.summary()
    assert "NaN or infinite" in report.summary()


@pytest.mark.parametrize("name", ["embedding", "token-classification", "question-answering"])
def test_nan_on_padded_positions_fails(graphs, name):
    """Padding is not compared, but a NaN there still reaches users: the python pooling multiplies padding by
    zero, and NaN times zero is NaN."""
    graph = graphs[name]
    output = graph["task"].output_names()[0]
    rank = graph["reference"].outputs[0][0].ndim
    path = _edited(graph["path"], graph["folder"] / f"{name}-nan-padding.onnx", output, nan_where(padding, rank))
    for precision in ("fp32", "int8"):
        report = _judge(graph, path, precision)
        assert _kinds(report) == {ValueMismatch}, report.summary()
        assert "all on padding" in report.summary()


def test_a_pooled_graph_with_nan_on_padded_token_states_serves_nan_and_fails(graphs):
    """The served graph (pooling, then the padding trim in front): NaN on the padded token states reach the
    mean pooling's sum, and so the served embedding, of every shorter row."""
    graph = graphs["embedding"]
    folder = graph["folder"]
    poisoned = _edited(graph["path"], folder / "poisoned.onnx", "last_hidden_state", nan_where(padding, 3))
    for states, label in ((graph["path"], "clean"), (poisoned, "poisoned")):
        pooled = add_pooling(states, folder / f"{label}-pooled.onnx", "last_hidden_state", "EMBEDDING", "mean",
                             True, COMMON["hidden_size"])
        served = add_padding_trim(pooled, folder / f"{label}-served.onnx", [])
        for precision in ("fp32", "bf16"):
            report = _judge(graph, served, precision, pooled="EMBEDDING", trims_padding=True)
            if label == "clean":
                assert report.passed, (precision, report.summary())
            else:
                assert ValueMismatch in _kinds(report), (precision, report.summary())


def test_a_pooled_graph_with_its_rows_reversed_fails_on_values_and_scores(graphs):
    graph = graphs["embedding"]
    folder = graph["folder"]
    pooled = add_pooling(graph["path"], folder / "rows-pooled.onnx", "last_hidden_state", "EMBEDDING", "mean", True,
                         COMMON["hidden_size"])
    path = _edited(pooled, folder / "rows-pooled-reversed.onnx", "EMBEDDING", reversed_along(0))
    assert ValueMismatch in _kinds(_judge(graph, path, "fp32", pooled="EMBEDDING"))
    assert _kinds(_judge(graph, path, "bf16", pooled="EMBEDDING")) & {FidelityShortfall, ScoreShortfall}
