"""PyTorch model to an fp32 ONNX graph with dynamic batch and sequence axes.

Past 2 GB of weights the TorchScript exporter writes one file per tensor beside
the graph; the graph is exported into a folder of its own and its tensors
gathered into one data file beside ``path`` (:mod:`onnx_files`).
"""

from __future__ import annotations

import inspect
import shutil
import warnings
from pathlib import Path
from typing import Any

import onnx
import torch
from torch import nn

from nexus_sli.exporter.errors import ExportError
from nexus_sli.tasks import TaskSpec

from . import onnx_files

OPSET = 17
TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def model_input_names(model: nn.Module, config: Any) -> list[str]:
    """The token inputs this model really uses: no ``token_type_ids`` for
    families without segment embeddings (DistilBERT, ModernBERT, DeBERTa with
    ``type_vocab_size == 0``)."""
    accepted = inspect.signature(model.forward).parameters
    names = ["input_ids", "attention_mask"]
    if "token_type_ids" in accepted and (getattr(config, "type_vocab_size", 0) or 0) > 0:
        names.append("token_type_ids")
    return names


class _KeywordCall(nn.Module):
    """Positional graph inputs -> keyword call: transformers 5 models take
    ``use_cache`` and friends positionally, so a positional export misbinds."""

    def __init__(self, model: nn.Module, task: TaskSpec, input_names: list[str]):
        super().__init__()
        self.model, self.task, self.input_names = model, task, input_names

    def forward(self, *inputs: torch.Tensor):
        output = self.model(**dict(zip(self.input_names, inputs)), return_dict=True)
        return self.task.select_outputs(output)


def export_onnx(model: nn.Module, task: TaskSpec, input_names: list[str], vocab_size: int, path: Path) -> list[str]:
    """Write the graph (and, past :data:`onnx_files.EXTERNAL_DATA_THRESHOLD`, its data file); return its
    input names as read back from the file."""
    wrapper = _KeywordCall(model, task, input_names).eval()  # a new Module starts in train mode
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, max(vocab_size, 6), (2, 16), generator=generator)
    example = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
    axes = {name: {0: "batch", 1: "sequence"} for name in input_names + task.output_names()}
    # torch writes a large graph's tensors as files named after them: keep those out of the work folder
    exported = path.parent / f"{path.stem}.torch" / path.name
    shutil.rmtree(exported.parent, ignore_errors=True)
    exported.parent.mkdir(parents=True)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tracer warnings about python control flow on shapes
            torch.onnx.export(
                wrapper,
                tuple(example[n] for n in input_names),
                str(exported),
                input_names=input_names,
                output_names=task.output_names(),
                dynamic_axes=axes,
                opset_version=OPSET,
                do_constant_folding=True,
                dynamo=False,
            )
        onnx.checker.check_model(str(exported))  # by path: a graph past 2 GB cannot be checked in memory
        onnx_files.gather(exported, path)
    except Exception as exc:
        raise ExportError(f"ONNX export failed: {type(exc).__name__}: {exc}") from exc
    finally:
        model.eval()
        shutil.rmtree(exported.parent, ignore_errors=True)
    return graph_input_names(path)


def graph_input_names(path: Path) -> list[str]:
    graph = onnx.load(str(path), load_external_data=False).graph
    initializers = {init.name for init in graph.initializer}
    return [i.name for i in graph.input if i.name not in initializers]
