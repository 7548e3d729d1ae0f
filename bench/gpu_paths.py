"""The GPU check's texts and in-process paths (bench/gpu_check.py, bench/gpu_served.py): the workloads'
texts, the exported graph as the served path computes it, and the PyTorch reference the export stored."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

#: Texts per call of the batch workloads.
BATCHES = (32, 256)
SINGLE_QUERIES = 64
#: A short text has at most this many tokens (the bench set's sentences and queries: 17 on average).
SHORT_TOKENS = 32
#: Short texts joined into one long text (about 150 tokens).
LONG_JOINED = 10


def reference_batches(repository: Path, model: str) -> list[tuple[dict, np.ndarray]]:
    """The stored validation text batches: (inputs, the PyTorch fp32 sentence embeddings, made from the
    stored token states the way the export's validation.json says the model pools them)."""
    from nexus_sli.exporter.export import export_report, stored_reference
    from nexus_sli.exporter.export.validate import embedder_from_report
    from nexus_sli.tasks import get_task

    folder = repository / f"{model}_encoder"
    exported = export_report.read(folder)
    reference = stored_reference.load(folder, list(exported.inputs), get_task(exported.task).output_names())
    embedder = embedder_from_report(exported)
    return [(inputs, embedder(outputs[0], inputs["attention_mask"]))
            for inputs, outputs in zip(reference.batches[reference.first_text:],
                                       reference.outputs[reference.first_text:])]


def reference_embeddings(repository: Path, model: str, tokenizer) -> tuple[list[str], np.ndarray]:
    """The validation texts and their PyTorch fp32 sentence embeddings as the export stored them, each text
    found by its tokens (the stored batches are sorted by length); a ValueError where one is missing."""
    from nexus_sli.exporter.export.validate import validation_texts

    stored = {}
    for inputs, want in reference_batches(repository, model):
        for ids, mask, vector in zip(inputs["input_ids"], inputs["attention_mask"], want):
            stored[tuple(ids[mask.astype(bool)].tolist())] = vector
    texts = validation_texts()
    keys = [tuple(e.ids) for e in tokenizer.encode_batch(texts)]
    missing = sum(key not in stored for key in keys)
    if missing:
        raise ValueError(f"{missing} of {len(texts)} validation texts are not in the stored reference: export the "
                         "repository with this version of nexus-sli")
    return texts, np.stack([stored[key] for key in keys])


def encoder_session(repository: Path, model: str, session_options=None, **provider_options):
    """The encoder's session as ``nexus-sli validate`` opens it: the providers its config.pbtxt names (with
    ``session_options``, an ``onnxruntime.SessionOptions``, and ``provider_options`` for the CUDA provider)."""
    from google.protobuf import json_format

    from nexus_sli.exporter.targets import TARGETS
    from nexus_sli.exporter.triton import config as tc

    folder = repository / f"{model}_encoder"
    config = json_format.MessageToDict(tc.read(folder / "config.pbtxt"), preserving_proto_field_name=True)
    session = TARGETS["onnxruntime-cuda"].open(folder / "1" / "model.onnx", {}, config=config)
    if provider_options or session_options is not None:  # the same providers, opened again with these options
        import onnxruntime as ort

        providers = [(name, {**options, **provider_options}) if name == "CUDAExecutionProvider" else (name, options)
                     for name, options in zip(session.get_providers(), session.get_provider_options().values())]
        session = ort.InferenceSession(str(folder / "1" / "model.onnx"), sess_options=session_options,
                                       providers=providers)
    return session, session.get_providers()


class Texts:
    """The workloads' texts: the bench set's short texts (at most :data:`SHORT_TOKENS` tokens), long texts of
    :data:`LONG_JOINED` short ones joined, and the shortest as single queries."""

    def __init__(self, tokenizer):
        from nexus_sli.bench.texts import bench_texts

        texts = bench_texts()
        counts = [len(e.ids) for e in tokenizer.encode_batch(texts)]
        self.short = [t for t, n in zip(texts, counts) if n <= SHORT_TOKENS]
        self.long = [" ".join(self.short[i:i + LONG_JOINED]) for i in range(0, len(self.short) - LONG_JOINED + 1,
                                                                             LONG_JOINED)]
        self.singles = sorted(self.short, key=len)[:SINGLE_QUERIES]

    def batches(self, kind: str, size: int, count: int) -> list[list[str]]:
        """``count`` calls of ``size`` texts of ``kind`` (short, long), going round the texts."""
        pool = self.short if kind == "short" else self.long
        return [[pool[(n * size + i) % len(pool)] for i in range(size)] for n in range(count)]

    def workloads(self) -> dict[str, list[list[str]]]:
        """name -> its calls: short texts in batches of 32 and 256, long ones in batches of 32."""
        return {f"short, batch {size}": self.batches("short", size, max(8, 2048 // size)) for size in BATCHES} | {
            "long, batch 32": self.batches("long", 32, 8)}


def step_tokenizer(repository: Path, model: str, truncate: bool = True):
    """The tokenizer step's parameters, and its tokenizer as the step loads it (truncating at its limit, unless
    ``truncate`` is false: to count a text's tokens)."""
    from nexus_sli.exporter.triton import config as tc
    from nexus_sli.exporter.triton.python_models.encoding import load_tokenizer
    from nexus_sli.tasks.model_parameters import TokenizerParameters, message_strings

    folder = repository / f"{model}_tokenizer"
    step = TokenizerParameters.read(message_strings(tc.read(folder / "config.pbtxt").parameters))
    return step, load_tokenizer(str(folder / "1" / "tokenizer.json"), step.max_length, truncate)


class GraphPath:
    """Texts -> EMBEDDING as the served path computes them: the tokenizer step's bucket padding, then
    the encoder graph on its config's providers, one ``session.run`` per call."""

    def __init__(self, repository: Path, model: str, **provider_options):
        self.session, providers = encoder_session(repository, model, **provider_options)
        print(f"gpu_check: the encoder graph runs on {providers}", flush=True)
        step, self.tokenizer = step_tokenizer(repository, model)
        self.max_length, self.widths, self.pad_id = step.max_length, list(step.widths), step.pad_id
        self.names = [i.name for i in self.session.get_inputs()]

    def feeds(self, texts: list[str]) -> dict[str, np.ndarray]:
        return self.arrays(self.tokenizer.encode_batch(texts))

    def arrays(self, encodings) -> dict[str, np.ndarray]:
        """The graph's inputs for ``encodings``, padded to the tokenizer step's bucket."""
        from nexus_sli.exporter.triton.python_models.encoding import padded_length, to_arrays

        width = padded_length(max(len(e.ids) for e in encodings), self.widths, self.max_length)
        return to_arrays(encodings, self.names, self.pad_id, width)

    def __call__(self, texts: list[str]) -> np.ndarray:
        return self.session.run(["EMBEDDING"], self.feeds(texts))[0]


def singles_ms(embed, texts: list[str]) -> list[float]:
    times = []
    for text in texts:
        started = time.perf_counter()
        embed([text])
        times.append((time.perf_counter() - started) * 1e3)
    return times


def latency(times: list[float]) -> dict:
    return {"p50_ms": float(np.percentile(times, 50)), "p99_ms": float(np.percentile(times, 99)), "queries": len(times)}
