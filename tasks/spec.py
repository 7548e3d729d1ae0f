"""A task spec: every fact about one served task, read by every layer.

The exporter builds the model and names the graph's outputs from it, the
Triton config writer lays out the ensemble's tensors, the post-processing
model picks its head by the spec's ``head``, validation judges reduced
precisions with its agreement metric, and the client reads its output name
and parses the answer with it.  Adding a task is one module of this package
(see :mod:`nexus_sli.tasks`) plus a head in the python models' ``heads.py``.
"""

from __future__ import annotations

import numbers

from dataclasses import dataclass
from typing import Any, Callable

from .model_parameters import ID2LABEL, write

#: Symbolic dims, resolved against the model when the Triton config is written.  ``EMBEDDED``: the
#: served embedding's size, the hidden size unless the model's Dense modules project it.
HIDDEN, LABELS, VOCAB, EMBEDDED = "hidden", "labels", "vocab", "embedded"


class TaskError(ValueError):
    """An unknown task name, or a second spec registered under one name."""


@dataclass(frozen=True)
class Tensor:
    """One tensor of the ensemble.  ``dtype`` is Triton's type name without ``TYPE_``;
    dims exclude the batch dimension and may name :data:`HIDDEN`, :data:`LABELS`, :data:`VOCAB` or :data:`EMBEDDED`."""

    name: str
    dtype: str
    dims: tuple[int | str, ...]

    def resolved(self, hidden_size: int, num_labels: int, vocab_size: int = 0, embedded_size: int = 0) -> "Tensor":
        """The tensor with its symbolic dims as sizes (``embedded_size`` 0: the hidden size)."""
        sizes = {HIDDEN: hidden_size, LABELS: num_labels, VOCAB: vocab_size, EMBEDDED: embedded_size or hidden_size}
        return Tensor(self.name, self.dtype, tuple(sizes.get(d, d) for d in self.dims))


def text(name: str, dims: tuple[int, ...] = (1,)) -> Tensor:
    return Tensor(name, "STRING", dims)


#: A graph that keeps its token states (:attr:`TaskSpec.token_states`) is served twice: ``NAME``
#: answers the task, ``NAME + TOKEN_MODEL_SUFFIX`` answers the token states, and ``NAME``'s ensemble
#: parameter ``model_parameters.TOKEN_MODEL`` names it.  That second ensemble's ``task`` parameter is
#: :data:`TOKEN_TASK` (not a task of its own: it is exported with the one it serves).
TOKEN_MODEL_SUFFIX, TOKEN_TASK = "_tokens", "token-embedding"
#: The second ensemble's other output: the tokenizer's attention mask, padded as the tokenizer pads.
#: Row i's real tokens are ``token_states[i, :TOKEN_MASK[i].sum()]`` (the states may be cut shorter
#: than the mask, never shorter than the longest real row of the batch).
TOKEN_MASK = Tensor("ATTENTION_MASK", "INT64", (-1,))


@dataclass(frozen=True)
class TaskSpec:
    name: str
    #: transformers auto class that builds the model for this task
    auto_class: str
    #: the encoder graph's outputs, in order: (graph output name, model output attribute)
    outputs: tuple[tuple[str, str], ...]
    #: the ensemble's raw string inputs, and its (the post-processing's) outputs
    inputs: tuple[Tensor, ...]
    results: tuple[Tensor, ...]
    #: the encoder outputs as Triton sees them (per row)
    encoder_outputs: tuple[Tensor, ...]
    #: the inputs of the post-processing head, by name (ensemble inputs, tokens, encoder outputs)
    post_inputs: tuple[str, ...]
    #: the tokenizer model's ``mode`` (single, pair, qa)
    tokenizer_mode: str
    #: the post-processing function's key in the python models' ``heads.HEADS``
    head: str
    #: how a reduced precision is judged against fp32: a :data:`tasks.agreement.METRICS` key,
    #: or None where embeddings are compared by cosine
    agreement: str | None
    #: reads the client's output array(s) into the task's result type
    parse: Callable[..., Any]
    #: whether a config's architecture says the checkpoint was trained for this task
    inferred_from: Callable[[str, Any], bool] | None = None
    #: why a checkpoint of this config cannot be served as this task, or None: asked before the export walks it,
    #: the task asked for or inferred
    refusal: Callable[[Any], str | None] = lambda config: None
    #: the post-processing parameters (also on the ensemble, for clients): (config, embedder) -> dict
    post_params: Callable[[Any, Any], dict[str, str]] = lambda config, embedder: {}
    #: tokenizer outputs besides the graph's own inputs (offsets, context_mask)
    token_extras: tuple[Tensor, ...] = ()
    #: one request is one item of a batch (False: a request is one query, rows explicit)
    batched: bool = True
    #: inputs are (first, second) text pairs: (query, document), (question, context)
    pair: bool = False
    #: the outputs have a sequence axis (one value per token), cut to the batch's real tokens
    per_token: bool = False
    #: what turns the graph's outputs into ``results`` inside the graph, so that the encoder answers
    #: them itself (tokenizer -> encoder, no post-processing step): ``sentence`` (mean, cls or max
    #: pooling and normalisation, as the model's sentence-transformers folder says), ``splade``
    #: (SPLADE pooling of masked-LM logits); None: the head of the post-processing step does it
    pooled_by: str | None = None
    #: where the graph pools: its token states kept as a second graph output (fp32, before pooling),
    #: which a second ensemble, ``NAME_tokens``, serves beside the pooled one (None: not kept)
    token_states: Tensor | None = None
    #: the ensemble answers each text's token count too (the tokenizer step's ``TOKEN_COUNT``,
    #: ``client/error_codes.py``), so an API that reports usage (OpenAI's) reads it from the same call
    usage: bool = False
    #: results the tokenizer step answers itself, as (result name, tokenizer output name): the ensemble maps
    #: that tokenizer output to the result (a late-interaction model's scoring mask, by which a client picks
    #: each text's vectors); the encoder or the post-processing makes the others
    token_results: tuple[tuple[str, str], ...] = ()
    #: checkpoint tensors outside the encoder that the task's own head reads (Stanford ColBERT's projection,
    #: a root ``linear.weight``): the layer walk accounts for them instead of refusing them as unconsumed
    head_tensors: tuple[str, ...] = ()

    def build(self, config: Any):
        import transformers

        return getattr(transformers, self.auto_class).from_config(config, attn_implementation="eager")

    def output_names(self) -> list[str]:
        return [name for name, _ in self.outputs]

    def select_outputs(self, model_output: Any) -> tuple:
        return tuple(getattr(model_output, attribute) for _, attribute in self.outputs)

    @property
    def client_output(self) -> str:
        """The ensemble output the client asks for."""
        return self.results[0].name


def check_top_k(top_k: Any, every: str) -> None:
    """Refuse a ``top_k`` that is not a positive integer or None (``every`` result, as the message says), as
    ``embed_sparse`` does: a slice by 0 or a negative number would drop results without a word."""
    # numbers.Integral: numpy's integers too (a top_k read from an array)
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None ({every}), got {top_k!r}")


def label_params(config: Any) -> dict[str, str]:
    """The label names a checkpoint's config carries, as the post-processing and clients read them."""
    labels = getattr(config, "id2label", None) or {}
    return write({ID2LABEL: {str(k): v for k, v in labels.items()}})


def sequence_classifier(architecture: str) -> bool:
    return architecture.endswith("ForSequenceClassification")


TASKS: dict[str, TaskSpec] = {}


def register(spec: TaskSpec) -> TaskSpec:
    """Add ``spec``; a second spec under one name is an error, never skipped."""
    if spec.name in TASKS:
        raise TaskError(f"task {spec.name!r} is registered twice")
    TASKS[spec.name] = spec
    return spec


def get_task(name: str) -> TaskSpec:
    if name not in TASKS:
        raise TaskError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    return TASKS[name]


def infer_task(config: Any) -> TaskSpec:
    """The task a checkpoint was trained for, from its architectures; the spec with
    no ``inferred_from`` (embedding) when none says."""
    for architecture in getattr(config, "architectures", None) or []:
        for spec in TASKS.values():
            if spec.inferred_from is not None and spec.inferred_from(architecture, config):
                return spec
    return next(spec for spec in TASKS.values() if spec.inferred_from is None)
