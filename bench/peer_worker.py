"""fastembed in its own venv: a worker process the bench talks to over a pipe.

Run by the fastembed venv's python (``bench/.peers/fastembed/venv/bin/python
bench/peer_worker.py --model-dir ...``), so it imports nothing of nexus-sli: only
the standard library, numpy and, inside :func:`serve`, fastembed.  The worker times
each call itself, as the user's own process would see it, and sends back the
seconds, the per-text latencies and the embeddings: the pipe is never on the clock.

The wire format (also imported by the bench, ``bench/peers.py``): a message is a
JSON header, then, when the header has ``"shape"``, the float32 array's raw bytes;
each part is framed by its length as an 8-byte big-endian integer.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
from typing import BinaryIO

import numpy as np

_LENGTH = struct.Struct(">Q")


def _write_frame(stream: BinaryIO, payload: bytes) -> None:
    stream.write(_LENGTH.pack(len(payload)))
    stream.write(payload)


def _read_exactly(stream: BinaryIO, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = stream.read(left)
        if not chunk:
            raise EOFError(f"the pipe closed {size - left} bytes into a {size}-byte frame")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def write_message(stream: BinaryIO, header: dict, array: np.ndarray | None = None) -> None:
    """One message: ``header`` (JSON), then ``array`` as float32 bytes (its shape goes into the header)."""
    if array is not None:
        array = np.ascontiguousarray(array, dtype=np.float32)
        header = {**header, "shape": list(array.shape)}
    _write_frame(stream, json.dumps(header).encode())
    if array is not None:
        _write_frame(stream, array.tobytes())
    stream.flush()


def read_message(stream: BinaryIO) -> tuple[dict, np.ndarray | None]:
    """The next message: its header, and its array when it carries one. EOFError when the pipe closed."""
    header = json.loads(_read_exactly(stream, _LENGTH.unpack(_read_exactly(stream, _LENGTH.size))[0]))
    if "shape" not in header:
        return header, None
    data = _read_exactly(stream, _LENGTH.unpack(_read_exactly(stream, _LENGTH.size))[0])
    return header, np.frombuffer(data, dtype=np.float32).reshape(header["shape"])


def batches(model, texts: list[str], batch_size: int) -> tuple[dict, np.ndarray]:
    """``TextEmbedding.embed(texts, batch_size=...)`` over the whole list: one wall-clock time."""
    start = time.perf_counter()
    vectors = np.stack(list(model.embed(texts, batch_size=batch_size)))
    return {"seconds": time.perf_counter() - start, "latencies_ms": []}, vectors


def one_at_a_time(model, texts: list[str], budget_s: float | None) -> tuple[dict, np.ndarray]:
    """Each text alone, after the previous one returned; stops once ``budget_s`` is spent
    (the rule of the bench's own single-query rows, ``bench/measure.py``)."""
    vectors, latencies = [], []
    start = time.perf_counter()
    for text in texts:
        t0 = time.perf_counter()
        vectors.append(np.asarray(next(iter(model.embed([text])))).reshape(-1))
        latencies.append((time.perf_counter() - t0) * 1e3)
        if budget_s is not None and time.perf_counter() - start > budget_s:
            break
    return {"seconds": time.perf_counter() - start, "latencies_ms": latencies}, np.stack(vectors)


def load(model_dir: str, model_id: str, pooling: str, normalize: bool, dim: int):
    """The model as a fastembed user gets it: fastembed's own entry when it lists ``model_id``
    (all-MiniLM-L6-v2 is listed), else a custom model with the checkpoint's pooling; either
    way its files come from ``model_dir`` (fastembed's ``specific_model_path``), not the hub."""
    from fastembed import TextEmbedding
    from fastembed.common.model_description import ModelSource, PoolingType

    listed = {m["model"].lower() for m in TextEmbedding.list_supported_models()}
    name = model_id
    if model_id.lower() not in listed:
        kinds = {"mean": PoolingType.MEAN, "cls": PoolingType.CLS}
        if pooling not in kinds:
            raise ValueError(f"fastembed has no {pooling!r} pooling (it has {', '.join(kinds)})")
        name = f"nexus-sli-bench/{os.path.basename(model_dir)}"
        TextEmbedding.add_custom_model(name, pooling=kinds[pooling], normalization=normalize,
                                       sources=ModelSource(hf=name), dim=dim, model_file="model.onnx")
    model = TextEmbedding(name, specific_model_path=model_dir, local_files_only=True)
    return model, {"fastembed_model": name, "listed_by_fastembed": name == model_id}


def serve(args: argparse.Namespace, inbox: BinaryIO, outbox: BinaryIO) -> None:
    """Load the model, say so, then answer requests until told to quit or the pipe closes."""
    try:
        model, facts = load(args.model_dir, args.model_id, args.pooling, args.normalize, args.dim)
        import onnxruntime

        facts.update(threads="fastembed's default (threads=None: onnxruntime's own "
                     f"intra-op default; {os.cpu_count()} logical CPUs here)",
                     onnxruntime_providers=onnxruntime.get_available_providers())
    except Exception as exc:  # reported to the bench, which records the peer as skipped with this reason
        write_message(outbox, {"error": f"{type(exc).__name__}: {exc}"})
        return
    write_message(outbox, {"ready": True, **facts})
    while True:
        try:
            request, _ = read_message(inbox)
        except EOFError:
            return
        if request["op"] == "quit":
            return
        try:
            if request["op"] == "batches":
                header, vectors = batches(model, request["texts"], request["batch_size"])
            elif request["op"] == "sequential":
                header, vectors = one_at_a_time(model, request["texts"], request.get("budget_s"))
            else:
                raise ValueError(f"unknown request {request['op']!r}: use batches, sequential or quit")
        except Exception as exc:  # the bench raises it on its side; the worker stays up for the next request
            write_message(outbox, {"error": f"{type(exc).__name__}: {exc}"})
            continue
        write_message(outbox, header, vectors)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True, help="folder with model.onnx and the tokenizer files")
    parser.add_argument("--model-id", required=True, help="the checkpoint's hub id (fastembed's name for it)")
    parser.add_argument("--pooling", default="mean")
    parser.add_argument("--normalize", action="store_true")
    parser.add_argument("--dim", type=int, required=True)
    args = parser.parse_args(argv)
    # The protocol owns the real stdout; anything a library prints goes to stderr (the bench's log file).
    outbox = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    serve(args, sys.stdin.buffer, outbox)
    return 0


if __name__ == "__main__":
    sys.exit(main())
