"""An ensemble's steps joined into one process, on the local ``nexus-sli serve`` path.

An exported ensemble runs two or three python-backend processes one after
the other (tokenizer, encoder, post-processing), and every hop through Triton
costs a short query time; under load the separate tokenizer process does not
win it back (bench/data/tried.md, "The tokenizer step under concurrent
load").  On a GPU the hops and copies cost about what the encoder's own run
does (docs/gpu.md, "Served on a GPU").  So where the encoder step runs on one
of our Python-based backends (the wheel's ``tritonserver``, whose python
backend sees this environment's packages), ``nexus-sli serve`` serves each
such batched ensemble as one python model,
``backends/joined_model.py``, that loads the steps' own code (the exported
``model.py`` files, the encoder shim) and runs them in turn on every request
of an execution: the same tokenizing, prompts, typed errors, length groups
and answers, without the hops.

It does so in a shadow of the repository, a temporary folder: the ensemble's
folder is rewritten there (a python model with the ensemble's name, inputs,
outputs and parameters, dynamically batched with the longest of the steps'
delays but without their queue policy, and the encoder's instance group: on a GPU
encoder, each instance is a process on that GPU), every other entry
is a link into the repository, and the repository on disk is unchanged: an
NGC container serves it as exported.  The step models stay served too (the
gateway's ``/tokenize`` calls the tokenizer model).  ``nexus-sli serve
--separate-steps`` serves the ensembles as exported.
"""

from __future__ import annotations

import json
import logging
import shutil
from importlib import resources
from pathlib import Path

from google.protobuf import json_format

from nexus_sli.exporter.triton import config as tc
from nexus_sli.exporter.triton.folders import newest_version
from nexus_sli.tasks.model_parameters import JOINED_BACKENDS, JOINED_SCHEDULE, JOINED_STEPS, TASK, write
from nexus_sli.tasks.spec import TOKEN_TASK

from . import temporary_folders
from .backend_folders import SHIM_BACKENDS

log = logging.getLogger(__name__)

_INT64 = (json_format.descriptor.FieldDescriptor.CPPTYPE_INT64, json_format.descriptor.FieldDescriptor.CPPTYPE_UINT64)


def triton_json(config: tc.pb.ModelConfig) -> dict:
    """``config`` as Triton hands it to a python model (``args["model_config"]``): protobuf's JSON with the
    proto's field names, and 64-bit integers (``dims`` ...) as numbers, not strings."""
    return _numbers(config, json_format.MessageToDict(config, preserving_proto_field_name=True))


def _numbers(message, data: dict) -> dict:
    for field in message.DESCRIPTOR.fields:
        if field.name not in data:
            continue
        value, written = getattr(message, field.name), data[field.name]
        if field.message_type is None:
            if field.cpp_type in _INT64:
                data[field.name] = [int(v) for v in written] if _repeated(field) else int(written)
        elif field.message_type.GetOptions().map_entry:
            if field.message_type.fields_by_name["value"].message_type is not None:
                for key in written:
                    _numbers(value[_key(field, key)], written[key])
        elif _repeated(field):
            for item, part in zip(value, written):
                _numbers(item, part)
        else:
            _numbers(value, written)
    return data


def _repeated(field) -> bool:
    # protobuf 6 has ``is_repeated`` and deprecates ``label``; earlier releases have only ``label``
    return field.is_repeated if hasattr(field, "is_repeated") else field.label == field.LABEL_REPEATED


def _key(field, key: str):
    return int(key) if field.message_type.fields_by_name["key"].cpp_type in _INT64 else key


def _version(model_dir: Path, wanted: int) -> str:
    """The version folder a step's ``model_version`` picks: itself, or the newest for -1."""
    if wanted > 0:
        return str(wanted)
    newest = newest_version(model_dir)
    if not newest:
        raise FileNotFoundError(f"{model_dir} has no version folder")
    return str(newest)


def _shim(config: tc.pb.ModelConfig) -> str | None:
    """The encoder shim that serves ``config`` locally, None where it is a python model."""
    if config.backend == "python":
        return None
    name = "onnxruntime" if config.platform == "onnxruntime_onnx" else config.backend
    if name not in SHIM_BACKENDS:
        raise ValueError(f"{config.name} runs on {config.platform or config.backend}, which no shim serves")
    return name


def step_sources(repository: Path, schedule: list[dict], backends: Path, instance_kind: str = "CPU",
                 device_id: str = "0") -> list[dict]:
    """For each step of ``schedule`` (the ensemble's steps, as :func:`joined_config` records them): the
    ``model.py`` that serves it here, the folder its helper modules are imported from, the ``args`` Triton
    would initialize it with, and its ``input_map`` and ``output_map``.  Read from ``repository`` when the
    joined model loads, so a reload reads the steps as they are then.  ``instance_kind`` and ``device_id``:
    the joined instance's (Triton's ``model_instance_kind`` and ``model_instance_device_id``), which every
    step shares: the encoder's session opens on that GPU."""
    sources = []
    for step in schedule:
        folder = repository / step["model_name"]
        config = tc.read(folder / "config.pbtxt")
        version = _version(folder, int(step.get("model_version", -1)))
        shim = _shim(config)
        code = (backends / shim if shim else folder / version) / "model.py"
        args = {"model_config": json.dumps(triton_json(config)), "model_repository": str(folder),
                "model_version": version, "model_name": config.name, "model_instance_kind": instance_kind,
                "model_instance_name": f"{config.name}_0", "model_instance_device_id": device_id}
        sources.append({"code": code, "args": args, "input_map": dict(step.get("input_map", {})),
                        "output_map": dict(step.get("output_map", {}))})
    return sources


def joined_config(ensemble: tc.pb.ModelConfig, steps: list[tc.pb.ModelConfig], backends: Path) -> tc.pb.ModelConfig:
    """The python model that serves ``ensemble`` (its name, inputs, outputs and parameters) by running
    ``steps`` (its steps' configs, in order) in one process."""
    config = tc.pb.ModelConfig(name=ensemble.name, backend="python", max_batch_size=ensemble.max_batch_size)
    config.input.extend(ensemble.input)
    config.output.extend(ensemble.output)
    for key, value in ensemble.parameters.items():
        config.parameters[key].CopyFrom(value)
    schedule = [json_format.MessageToDict(step, preserving_proto_field_name=True)
                for step in ensemble.ensemble_scheduling.step]
    for key, value in write({JOINED_STEPS: [s.model_name for s in ensemble.ensemble_scheduling.step],
                             JOINED_SCHEDULE: schedule, JOINED_BACKENDS: str(backends)}).items():
        config.parameters[key].string_value = value
    # Batched as the steps are, waiting for company as long as the most patient step would have.  Without the
    # steps' queue policy: with one, Triton 2.51's batcher left some requests sent right after the previous
    # answer waiting out its 500 ms idle timeout (bench/data/tried.md, "The ensemble's steps joined in one process")
    if ensemble.max_batch_size and steps[0].HasField("dynamic_batching"):
        config.dynamic_batching.max_queue_delay_microseconds = max(
            step.dynamic_batching.max_queue_delay_microseconds for step in steps)
    encoder = next(step for step in steps if _shim(step))
    config.instance_group.extend(encoder.instance_group)
    return config


def _joinable(repository: Path, ensemble: tc.pb.ModelConfig) -> list[tc.pb.ModelConfig] | None:
    """The configs of ``ensemble``'s steps, where one process can run them all; else None.  The process
    runs where the encoder's instances do (on a GPU for a ``KIND_GPU`` encoder); the other steps are
    python models, which run on the CPU wherever their process is.

    Not joined either: an ensemble without a batch dimension (reranking, question answering: the encoder's
    batcher merges the rows of concurrent requests, which one request per execution would not), and the
    token states' ensemble (a third copy of the encoder for a path that is rarely taken)."""
    task = ensemble.parameters[TASK.key].string_value if TASK.key in ensemble.parameters else ""
    if not ensemble.max_batch_size or task == TOKEN_TASK:
        return None
    steps, shims = [], 0
    for step in ensemble.ensemble_scheduling.step:
        path = repository / step.model_name / "config.pbtxt"
        if not path.is_file():
            return None
        config = tc.read(path)
        try:
            shims += _shim(config) is not None
        except ValueError:  # a TensorRT plan ...
            return None
        steps.append(config)
    return steps if shims == 1 else None


def _write_entry(model: Path, shadow: Path, ensembles: dict[str, tc.pb.ModelConfig]) -> None:
    """``model``'s folder in the shadow: a joined model where ``ensembles`` has it (at the ensemble's version: a
    client reads a new version in an answer as a changed model), else links into the repository."""
    (shadow / model.name).mkdir()
    if model.name in ensembles:
        tc.write(ensembles[model.name], shadow / model.name)
        version = shadow / model.name / _version(model, -1)
        version.mkdir()
        (version / "model.py").write_text(
            resources.files("nexus_sli.exporter.serving.backends").joinpath("joined_model.py").read_text())
        return
    # links to the repository's own paths, not their targets: a re-export replaces the folders
    for entry in model.iterdir():
        (shadow / model.name / entry.name).symlink_to(entry.absolute())


def _write_shadow(repository: Path, shadow: Path, ensembles: dict[str, tc.pb.ModelConfig]) -> None:
    for model in (p for p in repository.iterdir() if p.is_dir() and (p / "config.pbtxt").is_file()):
        _write_entry(model, shadow, ensembles)


def _joined_ensembles(repository: Path, backends: Path) -> dict[str, tc.pb.ModelConfig]:
    """The joined config of each of ``repository``'s ensembles that one process can serve, by name."""
    ensembles = {}
    for path in sorted(Path(repository).glob("*/config.pbtxt")):
        config = tc.read(path)
        if config.platform == "ensemble":
            steps = _joinable(Path(repository), config)
            if steps is not None:
                ensembles[config.name] = joined_config(config, steps, backends)
    return ensembles


def refresh(repository: Path, shadow: Path, backends: Path, names: list[str]) -> None:
    """Write the shadow's entries of the models ``names`` again, as ``repository`` holds them now (after a swap
    replaced their folders: new version folders, a joined model's new steps)."""
    ensembles = _joined_ensembles(repository, backends)
    for name in names:
        shutil.rmtree(shadow / name, ignore_errors=True)
        if (repository / name / "config.pbtxt").is_file():
            _write_entry(repository / name, shadow, ensembles)


def join(repository: Path, backends: Path) -> Path | None:
    """A shadow of ``repository`` whose batched ensembles are joined models, or None where none can be joined.
    ``backends``: the backend folder the server starts with (the encoder shims the joined models load)."""
    ensembles = _joined_ensembles(repository, backends)
    if not ensembles:
        return None
    shadow = temporary_folders.make(temporary_folders.JOINED_PREFIX)
    try:
        _write_shadow(Path(repository), shadow, ensembles)
    except BaseException:
        temporary_folders.remove(shadow)
        raise
    log.info("serving %s with each one's steps in one process (a shadow of %s in %s)",
             ", ".join(sorted(ensembles)), repository, shadow)
    return shadow
