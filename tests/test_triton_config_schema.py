"""Every config.pbtxt the exporter writes, for every task on every runtime target, read back through Triton's
protobuf schema (``tritonclient.grpc.model_config_pb2``) and held to the checks Triton's core runs when it
loads a repository: an ensemble's steps map only inputs and outputs their models have, every required input
is mapped, a tensor's data type and shape agree wherever it is produced or consumed (the batch dimension
added where a model batches: triton-inference-server/core ``ensemble_utils.cc``), no step allows fewer rows
than its ensemble, and the encoder's warm-up feeds exactly its inputs.  No weights: the configs only.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from nexus_sli.exporter.targets.registry import TARGETS
from nexus_sli.exporter.triton import config as tc
from nexus_sli.exporter.triton import models
from nexus_sli.tasks.spec import TASKS

pb = tc.pb
HIDDEN, LABELS, VOCAB, MAX_LENGTH = 64, 3, 100, 128


def _cases() -> list:
    """Every task on every target; a task that may pool in its graph both ways; default and asked-for rows."""
    return [pytest.param(task, target, pooled, rows, id=f"{task}-{target}-{'pooled' if pooled else 'plain'}-{rows}")
            for task, target in itertools.product(TASKS, TARGETS)
            for pooled in ((True, False) if TASKS[task].pooled_by else (False,)) for rows in (None, 8)]


def _write(root: Path, task: str, target: str, pooled: bool, rows: int | None) -> list[str]:
    spec, runtime = TASKS[task], TARGETS[target]
    serving = replace(runtime.serving("fp16" if runtime.device == "gpu" else "fp32"), rows=rows)
    inputs = ["input_ids", "attention_mask", "token_type_ids"]
    if pooled and any(t.name == "score_mask" for t in spec.token_extras):  # a late-interaction graph reads it
        inputs.append("score_mask")
    sides = SimpleNamespace(to_json=lambda: "{}") if spec.tokenizer_mode == "sided" else None
    facts = models.ServingFacts(inputs, HIDDEN, LABELS, MAX_LENGTH, 0, True, {}, serving, pooled=pooled,
                                vocab_size=VOCAB, sides=sides)
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = root / "tokenizer.json"
    tokenizer.write_text("{}")
    return models.write_models(root / "repository", "m", task, facts, tokenizer)


def _node(batching: bool, io) -> tuple[int, list[int], list[int]]:
    """A tensor as Triton's ensemble check sees it: (data type, dims, dims with the batch dimension)."""
    return io.data_type, list(io.dims), ([-1] if batching else []) + list(io.dims)


def _dims_agree(a: list[int], b: list[int]) -> bool:
    return len(a) == len(b) and all(x == y or -1 in (x, y) for x, y in zip(a, b))


def _consistent(known: dict, name: str, node, where: str) -> list[str]:
    if name not in known:
        known[name] = node
        return []
    seen = known[name]
    if seen[0] != node[0]:
        return [f"{where}: tensor {name} is {pb.DataType.Name(seen[0])} and {pb.DataType.Name(node[0])}"]
    if not _dims_agree(seen[1], node[1]) and not _dims_agree(seen[2], node[2]):
        return [f"{where}: tensor {name} has shapes {seen[2]} and {node[2]}"]
    return []


def _step_errors(ensemble, step, model, tensors: dict, produced: set) -> list[str]:
    where, batching = f"{ensemble.name} step {model.name}", model.max_batch_size > 0
    errors = [f"{where}: allows {model.max_batch_size} rows, the ensemble {ensemble.max_batch_size}"
              for _ in [0] if 0 < model.max_batch_size < ensemble.max_batch_size]
    inputs, outputs = {i.name: i for i in model.input}, {o.name: o for o in model.output}
    errors += [f"{where}: maps non-existing input {k}" for k in step.input_map if k not in inputs]
    errors += [f"{where}: maps non-existing output {k}" for k in step.output_map if k not in outputs]
    for name, model_input in inputs.items():
        if name not in step.input_map:
            errors += [] if model_input.optional else [f"{where}: required input {name} is not mapped"]
            continue
        tensor = step.input_map[name]
        errors += [] if tensor in produced else [f"{where}: reads {tensor} before any step makes it"]
        errors += _consistent(tensors, tensor, _node(batching, model_input), where)
    targets = list(step.output_map.values())
    errors += [f"{where}: two outputs map to one tensor"] if len(set(targets)) != len(targets) else []
    for name, tensor in step.output_map.items():
        if name in outputs:
            errors += _consistent(tensors, tensor, _node(batching, outputs[name]), where)
            produced.add(tensor)
    return errors


def ensemble_errors(ensemble, configs: dict) -> list[str]:
    """What Triton's ``ValidateEnsembleConfig`` would refuse in ``ensemble`` (its steps' configs by name)."""
    batching, tensors, errors = ensemble.max_batch_size > 0, {}, []
    for io in (*ensemble.input, *ensemble.output):
        errors += _consistent(tensors, io.name, _node(batching, io), ensemble.name)
    produced = {i.name for i in ensemble.input}
    for step in ensemble.ensemble_scheduling.step:
        errors += _step_errors(ensemble, step, configs[step.model_name], tensors, produced)
    return errors + [f"{ensemble.name}: output {o.name} is made by no step" for o in ensemble.output
                     if o.name not in produced]


def model_errors(folder: str, config) -> list[str]:
    """What Triton refuses of one model's own config, as far as these repositories use the fields."""
    errors = [] if config.name == folder else [f"{folder}: config names {config.name!r}"]
    if config.platform == "ensemble":
        if config.backend or len(config.instance_group) or len(config.model_warmup) or config.HasField(
                "dynamic_batching"):
            errors.append(f"{folder}: an ensemble with a backend, instances, warm-up or a batcher")
    elif not (config.platform or config.backend):
        errors.append(f"{folder}: neither platform nor backend")
    for io in (*config.input, *config.output):
        if not io.dims or any(d == 0 or d < -1 for d in io.dims):
            errors.append(f"{folder}: {io.name} has dims {list(io.dims)}")
    for warmup in config.model_warmup:
        inputs = {i.name: i for i in config.input}
        for name, sample in warmup.inputs.items():
            if name not in inputs or sample.data_type != inputs[name].data_type or len(sample.dims) != len(
                    inputs[name].dims):
                errors.append(f"{folder}: warm-up input {name} does not match the model's inputs")
        errors += [f"{folder}: warm-up lacks {name}" for name, i in inputs.items()
                   if name not in warmup.inputs and not i.optional]
        if not 0 < warmup.batch_size <= max(config.max_batch_size, 1):
            errors.append(f"{folder}: warm-up batch of {warmup.batch_size}")
    return errors


def _configs(root: Path) -> dict:
    return {path.parent.name: tc.read(path) for path in (root / "repository").glob("*/config.pbtxt")}


def _all_errors(configs: dict, ensembles: list[str]) -> list[str]:
    return ([e for folder, config in configs.items() for e in model_errors(folder, config)]
            + [e for name in ensembles for e in ensemble_errors(configs[name], configs)])


@pytest.mark.parametrize("task, target, pooled, rows", _cases())
def test_every_written_config_is_one_triton_loads(task, target, pooled, rows, tmp_path):
    ensembles = _write(tmp_path, task, target, pooled, rows)
    configs = _configs(tmp_path)
    assert set(ensembles) <= set(configs) and len(configs) >= 3
    assert _all_errors(configs, ensembles) == []
    expected_rows = rows or (tc.GPU_MAX_BATCH_SIZE if TARGETS[target].device == "gpu" else tc.MAX_BATCH_SIZE)
    assert configs["m_encoder"].max_batch_size == expected_rows


def _errors_with(root: Path, task: str, change) -> list[str]:
    """The errors found once ``change`` (configs by folder -> None) is made to a repository written for ``task``."""
    ensembles = _write(root, task, "onnxruntime", False, None)
    configs = _configs(root)
    change(configs)
    return _all_errors(configs, ensembles)


@pytest.mark.parametrize("task, change", [
    ("question-answering", lambda c: c["m_encoder"].input[0].dims.append(4)),  # [-1] became [-1, 4]
    ("question-answering", lambda c: setattr(c["m_postprocess"].input[1], "data_type", pb.TYPE_FP16)),
    ("question-answering", lambda c: c["m"].ensemble_scheduling.step[1].input_map.pop("attention_mask")),
    ("question-answering", lambda c: c["m"].ensemble_scheduling.step[2].output_map.clear()),
    ("question-answering", lambda c: c["m"].ensemble_scheduling.step[0].output_map.__setitem__("offsets", "X")),
    ("embedding", lambda c: setattr(c["m_encoder"], "max_batch_size", 8)),  # fewer rows than its ensemble
    ("embedding", lambda c: c["m_encoder"].model_warmup[0].inputs.pop("input_ids")),
    ("embedding", lambda c: setattr(c["m_tokenizer"], "name", "m_other")),
], ids=["dims", "dtype", "unmapped-input", "unmade-output", "unread-by-name", "rows", "warmup", "name"])
def test_the_checks_refuse_what_triton_refuses(task, change, tmp_path):
    """The checks above can fail: each mistake Triton would refuse, made in a written repository, is found."""
    assert _errors_with(tmp_path / "as-written", task, lambda configs: None) == []
    assert _errors_with(tmp_path / "changed", task, change) != []


def test_an_unbatched_step_in_a_batched_ensemble_is_accepted_where_shapes_agree(tmp_path):
    """Triton compares a tensor's shape with the batch dimension added where the model batches: the encoder
    taking ``[-1, -1]`` unbatched agrees with the tokenizer's ``[-1]`` batched."""
    def unbatched(configs):
        encoder = configs["m_encoder"]
        encoder.max_batch_size = 0
        encoder.ClearField("dynamic_batching")
        encoder.ClearField("model_warmup")
        for io in (*encoder.input, *encoder.output):
            io.dims.insert(0, -1)
    assert _errors_with(tmp_path, "embedding", unbatched) == []


def test_the_readmes_packed_environment_parameter_is_valid_config_text():
    """The README tells users to paste a ``parameters`` entry into the python models' config.pbtxt."""
    snippet = re.search(r"^ +(parameters: .*)$", models.REPOSITORY_README.format(), re.MULTILINE).group(1)
    parsed = tc.text_format.Parse(snippet, pb.ModelConfig())
    assert parsed.parameters["EXECUTION_ENV_PATH"].string_value == "$$TRITON_MODEL_DIRECTORY/env.tar.gz"
