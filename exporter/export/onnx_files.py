"""ONNX graphs on disk: one ``.onnx`` file, or, past protobuf's 2 GB limit, the graph and one data file.

A protobuf message cannot exceed 2 GiB, so a graph whose weights pass
:data:`EXTERNAL_DATA_THRESHOLD` keeps its tensors in one external data file
beside it, named after the graph that wrote it (``plain.onnx.data``); each
tensor records that name as its ``location``, relative to the graph's folder.
Every step that writes a graph goes through this module, so the decision has
one home and a graph never loses its weights on the way:

- :func:`save`: a graph in memory, in one file or with its data file, by size;
- :func:`rewrite`: a graph edited without loading its weights (pooling, padding
  trim): the new graph names the same data file, copied beside it;
- :func:`gather`: a graph copied under a new name with all of its external
  tensors in ``<new name>.data`` (the torch export's one file per tensor, the
  repository's ``model.onnx`` + ``model.onnx.data``), streamed, never in memory;
- :func:`detach`: a graph with its weights in a data file whatever its size,
  for a library that carries the graph without them (NNCF's ONNX backend);
- :func:`external` tells the steps that save through their own library
  (ONNX Runtime's quantizer and optimizer) which form to ask for.

Smaller graphs stay one file, as they always were.
"""

from __future__ import annotations

import filecmp
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import helper
from onnx.external_data_helper import ExternalDataInfo, uses_external_data

from nexus_sli.exporter.errors import ExportError

#: Weight bytes past which a graph is written with external data.  Protobuf refuses a message
#: of 2 GiB (2,147,483,647 bytes); 1.8 GB leaves 16% for what is not weights (nodes, names, the
#: shapes added by shape inference) and for steps that add tensors to a graph already saved in
#: one file (pooling, trim, the optimizer's concatenated attention weights), so no graph written
#: in one file can cross the limit later.  xlm-roberta-base (1.1 GB) stays one file;
#: xlm-roberta-large (2.24 GB) does not.  Tests lower it to send a tiny model down the same path.
EXTERNAL_DATA_THRESHOLD = 1_800_000_000
#: Tensors smaller than this stay inside the graph even when it has a data file (ONNX's default).
INLINE_BYTES = 1024
#: The data file's name beside a graph: ONNX Runtime's optimizer and quantizer use the same.
DATA_SUFFIX = ".data"
#: Bytes copied per read when data is streamed from one file to another.
_CHUNK = 64 << 20


def data_path(graph: Path) -> Path:
    """Where :func:`save` and :func:`gather` put the external data of ``graph``."""
    return graph.with_name(graph.name + DATA_SUFFIX)


def _tensors(graph: onnx.GraphProto):
    """Every tensor of ``graph``: initializers and the values of tensor attributes, subgraphs included."""
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.TENSOR:
                yield attribute.t
            yield from attribute.tensors
            for subgraph in [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else attribute.graphs:
                yield from _tensors(subgraph)


def _external_tensors(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    return [t for t in _tensors(model.graph) if uses_external_data(t)]


def weight_bytes(model: onnx.ModelProto) -> int:
    """The bytes of the graph's tensors, from their shapes and types: read without touching their data
    (serialising a 2 GB graph only to measure it takes seconds), so it holds for external tensors too."""
    return sum(int(np.prod(t.dims, dtype=np.int64)) * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
               for t in _tensors(model.graph) if t.data_type != onnx.TensorProto.STRING)


def data_files(path: Path) -> list[Path]:
    """The external data files the graph at ``path`` names (beside it), in the order they are first named."""
    model = onnx.load(str(path), load_external_data=False)
    locations = dict.fromkeys(ExternalDataInfo(t).location for t in _external_tensors(model))
    return [Path(path).parent / location for location in locations]


def files(path: Path) -> list[Path]:
    """The graph's file and its data files: what has to travel together."""
    return [Path(path), *data_files(path)]


def external(path: Path) -> bool:
    """Whether a graph derived from the one at ``path`` is to be written with external data: it has a
    data file already, or its weights pass :data:`EXTERNAL_DATA_THRESHOLD`."""
    model = onnx.load(str(path), load_external_data=False)
    return bool(_external_tensors(model)) or weight_bytes(model) > EXTERNAL_DATA_THRESHOLD


def _remove_data(graph: Path) -> None:
    """A data file left by an earlier write of ``graph``: ONNX appends to an existing one."""
    data_path(graph).unlink(missing_ok=True)


def save(model: onnx.ModelProto, path: Path) -> Path:
    """``model`` (its tensors in memory) at ``path``: one file, or past :data:`EXTERNAL_DATA_THRESHOLD`
    the graph and ``<name>.data`` holding every tensor of :data:`INLINE_BYTES` or more."""
    path = Path(path)
    _remove_data(path)
    if weight_bytes(model) <= EXTERNAL_DATA_THRESHOLD:
        onnx.save_model(model, str(path))
    else:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data_path(path).name, size_threshold=INLINE_BYTES)
    return path


def prepare(target: Path) -> Path:
    """``target`` ready for a library that writes ``<name>.data`` itself (ONNX Runtime's quantizer and
    optimizer append to an existing one): any earlier data file removed."""
    _remove_data(Path(target))
    return Path(target)


def _copy(source: Path, target: Path) -> None:
    """``source`` as ``target``, unless it is there already.  A copy, not a hard link: ONNX refuses to read
    external data from a file with several links ("a potential hardlink attack")."""
    if target.exists():
        if os.path.samefile(source, target) or (target.stat().st_size == source.stat().st_size
                                                 and filecmp.cmp(source, target, shallow=False)):
            return
        # another graph's weights under the same name: replacing them would break that graph
        raise ExportError(f"cannot put {source} beside its graph as {target}: a different file of that name is there")
    shutil.copyfile(source, target)


def detach(source: Path, target: Path) -> Path:
    """The graph at ``source`` as ``target`` with every tensor of :data:`INLINE_BYTES` or more in
    ``<target name>.data``, whatever its size: for a library that serializes the graph at each of its steps
    (NNCF's ONNX backend), which then carries a graph without its weights and reads them from the file."""
    source, target = Path(source), Path(target)
    model = onnx.load(str(source))
    _remove_data(target)
    onnx.save_model(model, str(target), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data_path(target).name, size_threshold=INLINE_BYTES)
    return target


def rewrite(source: Path, target: Path, edit: Callable[[onnx.ModelProto], None]) -> Path:
    """The graph at ``source``, changed by ``edit``, as ``target``, its weights never loaded.

    A graph of one file is read and written whole (it is under the threshold); a graph with external
    data keeps naming its data files, which are copied beside ``target`` when it is in another folder.
    ``edit`` adds nodes and small tensors; it must not change an external tensor's data."""
    source, target = Path(source), Path(target)
    model = onnx.load(str(source), load_external_data=False)
    edit(model)
    onnx.save_model(model, str(target))
    if source.parent.resolve() != target.parent.resolve():
        for data in data_files(source):
            _copy(data, target.parent / data.name)
    return target


def gather(source: Path, target: Path) -> Path:
    """The graph at ``source`` as ``target``, with every external tensor in ``<target name>.data``.

    One data file is copied under the new name; several (the torch exporter writes one per tensor) are
    streamed into one.  A graph without external data is copied as it is, unless its
    weights pass :data:`EXTERNAL_DATA_THRESHOLD` (then it is saved with a data file)."""
    source, target = Path(source), Path(target)
    model = onnx.load(str(source), load_external_data=False)
    tensors = _external_tensors(model)
    if not tensors:
        if weight_bytes(model) <= EXTERNAL_DATA_THRESHOLD:
            _remove_data(target)
            shutil.copyfile(source, target)
            return target
        return save(model, target)
    data = data_path(target)
    _remove_data(target)
    locations = {ExternalDataInfo(t).location for t in tensors}
    if len(locations) == 1:
        _copy(source.parent / locations.pop(), data)
        for tensor in tensors:
            info = ExternalDataInfo(tensor)
            _point(tensor, data.name, info.offset, info.length)
    else:
        _stream(source.parent, tensors, data)
    onnx.save_model(model, str(target))
    return target


def _point(tensor: onnx.TensorProto, location: str, offset: int | None, length: int | None) -> None:
    """``tensor``'s data is ``length`` bytes at ``offset`` of ``location`` (ONNX's own setter wants the data
    in memory, which is what streaming avoids)."""
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        if value is not None:
            entry = tensor.external_data.add()
            entry.key, entry.value = key, str(value)


def _stream(folder: Path, tensors: list[onnx.TensorProto], data: Path) -> None:
    """Copy each tensor's bytes from its file in ``folder`` to the end of ``data`` and point it there."""
    with open(data, "wb") as out:
        for tensor in tensors:
            info = ExternalDataInfo(tensor)
            offset = out.tell()
            with open(folder / info.location, "rb") as handle:
                handle.seek(info.offset or 0)
                # the torch exporter writes one file per tensor and records neither offset nor length
                remaining = info.length if info.length else os.fstat(handle.fileno()).st_size - (info.offset or 0)
                while remaining > 0:
                    chunk = handle.read(min(_CHUNK, remaining))
                    if not chunk:
                        raise ExportError(f"{folder / info.location} ends before {tensor.name}'s data does")
                    out.write(chunk)
                    remaining -= len(chunk)
            _point(tensor, data.name, offset, out.tell() - offset)
