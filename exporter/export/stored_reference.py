"""The PyTorch reference an export validated against, kept beside the model.

``nexus-sli validate`` runs it again through the runtime a repository's config
names, on the machine that serves it (a GPU host needs no PyTorch for that):
the inputs of every parity case and text batch, and PyTorch fp32's outputs;
and where the graph alone holds what turns those outputs into the served ones
(BGE-M3's heads), that too (:func:`embedder_arrays`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from nexus_sli.exporter.errors import NexusError

from .validate import Reference

#: The file, in the encoder's model folder beside ``validation.json``.
FILE = "reference.npz"
#: the prefix of the embedder's arrays in it
EMBEDDER = "embedder."


def save(reference: Reference, folder: Path, embedder: dict[str, np.ndarray] | None = None) -> Path:
    """``reference`` into ``folder``; ``embedder``: the arrays the embedder needs to be rebuilt where
    validation.json does not keep them (:func:`embedder_arrays` reads them back)."""
    arrays = {"text_batches": np.array(reference.text_batches)}
    arrays.update({EMBEDDER + name: value for name, value in (embedder or {}).items()})
    for index, (feeds, outputs) in enumerate(zip(reference.batches, reference.outputs)):
        arrays.update({f"in.{index}.{name}": value for name, value in feeds.items()})
        arrays.update({f"out.{index}.{position}": value for position, value in enumerate(outputs)})
    path = folder / FILE
    np.savez_compressed(path, **arrays)
    return path


def load(folder: Path, input_names: list[str], output_names: list[str]) -> Reference:
    path = folder / FILE
    if not path.is_file():
        raise NexusError(f"{path} is missing: export the model again with this version of nexus-sli "
                         "(it keeps the reference beside the model)")
    with np.load(path) as stored:
        reference = Reference(input_names, output_names, text_batches=int(stored["text_batches"]))
        batches = 1 + max(int(key.split(".")[1]) for key in stored.files if key.startswith("in."))
        for index in range(batches):
            reference.add({name: stored[f"in.{index}.{name}"] for name in input_names},
                          [stored[f"out.{index}.{position}"] for position in range(len(output_names))])
    return reference


def embedder_arrays(folder: Path) -> dict[str, np.ndarray]:
    """The embedder's arrays :func:`save` kept beside the reference (empty where it kept none)."""
    path = folder / FILE
    if not path.is_file():
        return {}
    with np.load(path) as stored:
        return {key[len(EMBEDDER):]: stored[key] for key in stored.files if key.startswith(EMBEDDER)}
