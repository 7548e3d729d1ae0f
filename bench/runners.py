"""In-process encoders: the baseline and the peers the served path is compared with.

Each takes a list of texts and returns their embeddings ``[n, hidden]``,
tokenizing included.  Like ``SentenceTransformer.encode``, the PyTorch and
ONNX Runtime peers sort the texts by length before cutting batches of 32 (less
padding) and return the embeddings in the caller's order, so the in-process
rows differ only in the engine.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nexus_sli.exporter.export import export_report
from nexus_sli.exporter.triton import config as triton_config
from nexus_sli.exporter.triton.python_models.encoding import load_tokenizer, to_arrays
from nexus_sli.exporter.export.validate import Embedder
from nexus_sli.tasks.model_parameters import TokenizerParameters, message_strings

log = logging.getLogger(__name__)

BATCH_SIZE = 32


@dataclass(frozen=True)
class ServedFacts:
    """What the exported repository says about tokenizing and pooling: the in-process
    peers tokenize and pool exactly as the served model does."""

    name: str
    tokenizer_json: Path
    input_names: list[str]
    max_length: int
    pad_id: int
    pooling: str
    normalize: bool

    @classmethod
    def read(cls, repository: Path, name: str) -> "ServedFacts":
        report = export_report.read(repository / f"{name}_encoder")
        step = TokenizerParameters.read(message_strings(
            triton_config.read(repository / f"{name}_tokenizer" / "config.pbtxt").parameters))
        return cls(name, repository / f"{name}_tokenizer" / "1" / "tokenizer.json", list(report.inputs),
                   step.max_length, step.pad_id,
                   report.pooling, bool(report.normalize))

    def tokenizer(self):
        return load_tokenizer(str(self.tokenizer_json), self.max_length)

    def embedder(self) -> Embedder:
        return Embedder(self.pooling, self.normalize)


def token_counts(facts: ServedFacts, texts: list[str], truncate: bool = True) -> list[int]:
    """Tokens per text, special tokens included (truncated at the model limit unless told)."""
    tokenizer = facts.tokenizer()
    if not truncate:
        tokenizer.no_truncation()
    return [len(e.ids) for e in tokenizer.encode_batch(list(texts))]


def _feeds(encodings, input_names: list[str], pad_id: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """One batch padded to its longest text: the graph's inputs, and the attention mask for pooling."""
    names = list(dict.fromkeys([*input_names, "attention_mask"]))
    arrays = to_arrays(encodings, names, pad_id, max(len(e.ids) for e in encodings))
    return {name: arrays[name] for name in input_names}, arrays["attention_mask"]


def sorted_batches(lengths: list[int], size: int = BATCH_SIZE) -> list[np.ndarray]:
    """Index batches, longest texts first (what sentence-transformers does)."""
    order = np.argsort([-n for n in lengths], kind="stable")
    return [order[i:i + size] for i in range(0, len(order), size)]


def torch_thread_counts() -> list[int]:
    """torch's default intra-op thread count, and 1 where that differs.

    On a shared machine whose other processes keep the cores busy, torch's
    OpenMP threads wait on each other at every parallel region, and a single
    query can take several times longer with a thread per core than with one
    (bench/data/tried.md, "torch's threads on a loaded machine").  The baseline
    is timed both ways and the faster is the reference, so a loaded machine
    never flatters the served path."""
    import torch

    default = torch.get_num_threads()
    return [default, 1] if default > 1 else [default]


@contextlib.contextmanager
def torch_threads(count: int | None):
    import torch

    previous = torch.get_num_threads()
    if count:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class SentenceTransformersEncoder:
    """The baseline: ``SentenceTransformer.encode(texts, batch_size=32)``, fp32."""

    path = "sentence-transformers"

    def __init__(self, model, threads: int | None = None):
        self.model, self.threads = model, threads

    @classmethod
    def load(cls, model_dir: Path):
        from sentence_transformers import SentenceTransformer

        return SentenceTransformer(str(model_dir), device="cpu")

    def __call__(self, texts: list[str]) -> np.ndarray:
        with torch_threads(self.threads):
            return self.model.encode(list(texts), batch_size=BATCH_SIZE, convert_to_numpy=True,
                                     show_progress_bar=False)


class TorchEncoder:
    """transformers ``AutoModel`` + the served tokenizer and pooling; fp32, or bf16 autocast."""

    path = "pytorch"

    def __init__(self, model, facts: ServedFacts, bf16: bool = False, threads: int | None = None):
        import torch

        self.torch = torch
        self.model = model
        self.tokenizer = facts.tokenizer()
        self.facts = facts
        self.embedder = facts.embedder()
        self.bf16, self.threads = bf16, threads

    @classmethod
    def load(cls, model_dir: Path):
        from transformers import AutoModel

        return AutoModel.from_pretrained(str(model_dir), trust_remote_code=False).eval()

    def __call__(self, texts: list[str]) -> np.ndarray:
        torch = self.torch
        encodings = self.tokenizer.encode_batch(list(texts))
        out: list[np.ndarray | None] = [None] * len(texts)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()
        with torch_threads(self.threads), torch.inference_mode(), autocast:
            for batch in sorted_batches([len(e.ids) for e in encodings]):
                feeds, mask = _feeds([encodings[i] for i in batch], self.facts.input_names, self.facts.pad_id)
                hidden = self.model(**{k: torch.from_numpy(v) for k, v in feeds.items()}).last_hidden_state
                vectors = self.embedder(hidden.float().numpy(), mask)
                for row, index in enumerate(batch):
                    out[index] = vectors[row]
        return np.stack(out)


class GraphEncoder:
    """The exported encoder the server runs, in process: ONNX Runtime on
    ``<name>_encoder/1/model.onnx``, or OpenVINO on its ONNX or IR with the
    config's precision hint (the exporter's own validation session).  A graph
    that ends in the pooling (``[batch, hidden]`` out) answers the embeddings
    itself; an older graph's token states are pooled here as its ensemble's
    post-processing does."""

    def __init__(self, session, facts: ServedFacts, path: str):
        self.session, self.path = session, path
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.output = self.session.get_outputs()[0].name
        self.tokenizer = facts.tokenizer()
        self.facts = facts
        self.embedder = facts.embedder()

    @classmethod
    def for_model(cls, repository: Path, facts: ServedFacts) -> "GraphEncoder":
        from nexus_sli.exporter.targets import serving_target

        config = triton_config.read(repository / f"{facts.name}_encoder" / "config.pbtxt")
        model = repository / f"{facts.name}_encoder" / "1" / (config.default_model_filename or "model.onnx")
        kind = triton_config.pb.ModelInstanceGroup.Kind.Name(config.instance_group[0].kind)
        target = serving_target(config.platform, config.backend, kind)
        return cls(target.open(model, message_strings(config.parameters)), facts, target.name)

    def __call__(self, texts: list[str]) -> np.ndarray:
        encodings = self.tokenizer.encode_batch(list(texts))
        out: list[np.ndarray | None] = [None] * len(texts)
        for batch in sorted_batches([len(e.ids) for e in encodings]):
            feeds, mask = _feeds([encodings[i] for i in batch], self.inputs, self.facts.pad_id)
            (output,) = self.session.run([self.output], feeds)
            if output.ndim == 2:  # [batch, hidden]: pooled (and normalised) in the graph
                vectors = output
            else:
                vectors = self.embedder(output, mask[:, :output.shape[1]])  # the graph cuts trailing padding
            for row, index in enumerate(batch):
                out[index] = vectors[row]
        return np.stack(out)


def has_sentence_transformers_config(model_dir: Path) -> bool:
    return (model_dir / "modules.json").is_file()
