"""The served models' parameters: every key of their ``config.pbtxt``'s ``parameters`` map, its type, and how
its value is written and read.

Triton's ``parameters`` is a free map of strings: protobuf takes any key, so a key that a writer renames and
a reader still asks for fails only when the model is served.  So each key is declared once, here, as a
:class:`Parameter` that knows its value's type.  The writers (``exporter/triton/config.py`` and
``models.py``, the task specs' ``post_params``, the export's prompts and sizes, the runtime targets' encoder
parameters, ``nexus-sli serve``'s joined steps) and the readers (the tokenizer and post-processing steps, the
encoder backends, the client's ``ModelInfo``, the gateway, the bench) name a key through its constant, and
``tests/test_model_parameters.py`` checks that every key of every exported config is declared here.

The models and their keys:

- ``NAME_tokenizer``: :data:`TOKENIZER`, read and written as one :class:`TokenizerParameters`, and the
  model's prompts (:class:`Prompts`);
- ``NAME_postprocess``: :data:`TASK`, :data:`HEAD` and the task's own parameters (:data:`TASK_PARAMETERS`,
  a task spec's ``post_params``), which its head reads;
- ``NAME`` (the ensemble): :data:`TASK`, the task's parameters, the prompts and what clients read besides
  (:data:`DESCRIBED`); ``NAME_tokens``: :data:`TASK`, the prompts and :data:`EMBEDDING_MODEL`;
- ``NAME_encoder``: the parameters of Triton's OpenVINO backend (:data:`ENCODER`), where it serves it;
- an ensemble ``nexus-sli serve`` runs as one python model: its own and :data:`JOINED`.

This file is copied beside the python steps in every repository, as ``client/error_codes.py`` is: on a
Triton server nexus-sli is not installed, so it imports nothing but the standard library.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class _Required:
    """The default of a parameter a reader cannot do without (:meth:`Parameter.read`)."""

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()


def _flag(text: str) -> bool:
    return text == "true"


def _flag_text(value: bool) -> str:
    return "true" if value else "false"


def _integers(text: str) -> tuple[int, ...]:
    return tuple(int(item) for item in text.split(","))


def _integers_text(values: Iterable[int]) -> str:
    return ",".join(str(int(value)) for value in values)


def _names(text: str) -> tuple[str, ...]:
    return tuple(name for name in text.split(",") if name)


def _names_text(values: str | Iterable[str]) -> str:
    """Names, comma-separated: a sequence of them, or a string that already is that."""
    return values if isinstance(values, str) else ",".join(values)


@dataclass(frozen=True)
class Parameter(Generic[T]):
    """One key of a model's ``parameters``, and how its string value is read (``parse``) and written
    (``format``)."""

    key: str
    parse: Callable[[str], T] = str  # type: ignore[assignment]
    format: Callable[[T], str] = str

    def text(self, value: T) -> str:
        """``value`` as the config holds it."""
        return self.format(value)

    def read(self, params: Mapping[str, str], default: Any = REQUIRED) -> T:
        """The value in ``params`` (a config's parameters as strings, :func:`strings`), or ``default`` where
        the key is absent; a ValueError naming the key where it is absent without a default, or unreadable."""
        if self.key not in params:
            if default is REQUIRED:
                raise ValueError(f"the model's config has no parameter {self.key!r}")
            return default
        try:
            return self.parse(params[self.key])
        except ValueError as exc:
            raise ValueError(f"the model's parameter {self.key!r} is {params[self.key]!r}: {exc}") from None


def text(key: str) -> Parameter[str]:
    return Parameter(key)


def integer(key: str) -> Parameter[int]:
    return Parameter(key, int)


def flag(key: str) -> Parameter[bool]:
    """``true`` or ``false``; anything but ``true`` reads as False."""
    return Parameter(key, _flag, _flag_text)


def integers(key: str) -> Parameter[tuple[int, ...]]:
    """Integers, comma-separated."""
    return Parameter(key, _integers, _integers_text)


def names(key: str) -> Parameter[tuple[str, ...]]:
    """Names, comma-separated."""
    return Parameter(key, _names, _names_text)


def json_value(key: str) -> Parameter[Any]:
    return Parameter(key, json.loads, json.dumps)


# The tokenizer step's (NAME_tokenizer; tokenizer_model.py).
#: how requests become rows: ``single``, ``pair``, ``qa`` or ``sided`` (``encoding.TOKENIZER_MODES``)
MODE = text("mode")
#: the most tokens of one row
MAX_LENGTH = integer("max_length")
#: the id padding is filled with
PAD_ID = integer("pad_id")
#: whether a longer text is cut to ``max_length`` (else refused)
TRUNCATE = flag("truncate")
#: the widths a batch is padded to, the smallest that fits its longest row (``encoding.padded_length``)
PAD_WIDTHS = integers("pad_widths")
#: the overlap, in tokens, of a long context's windows (mode ``qa``)
STRIDE = integer("stride")
#: the most encoder rows one request may become (the modes whose request is one query: ``pair``, ``qa``)
MAX_ROWS = integer("max_rows")
#: a late-interaction model's two sides (mode ``sided``): ``sides.Sides.to_json()``, read by ``Sides.from_json``
SIDES = text("sides")

# The prompts: the tokenizer step applies them, the ensembles describe them to clients.
#: the model's named prompts (sentence-transformers' ``prompts``), JSON: name -> text put in front of each text
PROMPTS = json_value("prompts")
#: the prompt applied where a request names none (absent: none)
DEFAULT_PROMPT_NAME = text("default_prompt_name")

# The post-processing step's and the ensembles'.
#: the task spec's name (:mod:`nexus_sli.tasks`); a token ensemble's is ``spec.TOKEN_TASK``
TASK = text("task")
#: the post-processing function, a key of ``heads.HEADS`` (the task spec's ``head``)
HEAD = text("head")

# A task's own (its spec's ``post_params``): the post-processing head reads them, the ensemble describes them.
#: how token states become one vector: ``mean``, ``cls`` or ``max`` (``encoding.POOLING_MODES``)
POOLING = text("pooling")
#: whether the served vectors are L2-normalised
NORMALIZE = flag("normalize")
#: a classifier's or tagger's labels, JSON: ``{"0": "label", ...}``
ID2LABEL = json_value("id2label")
#: whether a classifier's labels are independent (sigmoids, not one softmax); its head reads it only where
#: :data:`SCORE_FUNCTION` is absent (a repository exported before it)
MULTI_LABEL = flag("multi_label")
#: how a classifier's logits become scores: ``softmax``, ``sigmoid`` or ``none`` (``heads.SCORE_FUNCTIONS``,
#: transformers' TextClassificationPipeline's ``function_to_apply``, chosen as it chooses from the config)
SCORE_FUNCTION = text("function_to_apply")
#: a sparse model's SpladePooling strategy and activation (``encoding.SPLADE_STRATEGIES``, ``SPLADE_ACTIVATIONS``)
SPLADE_POOLING = text("splade_pooling")
SPLADE_ACTIVATION = text("splade_activation")
#: the vocabulary a sparse model's ``[vocab]`` rows index
VOCAB_SIZE = integer("vocab_size")
#: a late-interaction model's score: ``maxsim`` or ``meanmaxsim``
SIMILARITY = text("similarity")
#: the size of a multi-vector model's token vectors
VECTOR_SIZE = integer("vector_size")
#: the sides a multi-vector model's requests may name (``input_type``), comma-separated
INPUT_TYPES = names("input_types")
#: the tasks a model serves besides its own (BGE-M3), comma-separated
SERVES = names("serves")
#: how BGE-M3's sparse weights come: ``tokens`` (per token, with their ids)
SPARSE_FORM = text("sparse_form")
#: answers a question-answering head keeps (not written by an export; its default is ``heads.TOP_ANSWERS``)
TOP_K = integer("top_k")
#: whether a question-answering head answers "no answer" too, the empty answer (0, 0) scored by the model's
#: [CLS] (transformers' ``handle_impossible_answer``; not written by an export, absent: false)
IMPOSSIBLE_ANSWER = flag("handle_impossible_answer")

# What the ensembles tell clients besides (ModelInfo).
#: the precision the encoder was exported in (``fp32``, ``fp16``, ``int8`` ...)
PRECISION = text("precision")
#: the runtime target serving the encoder (``onnxruntime``, ``openvino`` ...: ``targets.TARGETS``' names)
BACKEND = text("backend")
#: the sizes a Matryoshka model was trained for, largest first, JSON
MATRYOSHKA_DIMS = json_value("matryoshka_dims")
#: the ensemble serving this one's token states (``NAME_tokens``, ``spec.TOKEN_MODEL_SUFFIX``)
TOKEN_MODEL = text("token_model")
#: the token ensemble's: the ensemble whose token states it serves
EMBEDDING_MODEL = text("embedding_model")

# The encoder's, where Triton's OpenVINO backend serves it (its own names; backends/openvino_backend.py reads
# them where the wheel's Triton lacks that backend).
#: ``YES``: bf16 inference precision; anything else keeps f32
HINT_BF16 = text("HINT_BF16")
#: OpenVINO's performance hint (``LATENCY``, ``THROUGHPUT``)
PERFORMANCE_HINT = text("PERFORMANCE_HINT")
#: passed on to OpenVINO's CPU plugin as they are
INFERENCE_NUM_THREADS = text("INFERENCE_NUM_THREADS")
NUM_STREAMS = text("NUM_STREAMS")
#: ours: one query of every length up to this many tokens is run when the model loads
WARMUP_QUERY_TOKENS = integer("WARMUP_QUERY_TOKENS")

# The python model ``nexus-sli serve`` runs in an ensemble's place (serving/joined_steps.py).
#: the ensemble's steps, comma-separated, the tokenizer first
JOINED_STEPS = names("joined_steps")
#: the ensemble's steps as its config schedules them, JSON
JOINED_SCHEDULE = json_value("joined_schedule")
#: the folder of the encoder shims the steps load
JOINED_BACKENDS = text("joined_backends")

#: The keys of each kind of model.
TOKENIZER = (MODE, MAX_LENGTH, PAD_ID, TRUNCATE, PAD_WIDTHS, STRIDE, MAX_ROWS, SIDES, PROMPTS, DEFAULT_PROMPT_NAME)
TASK_PARAMETERS = (POOLING, NORMALIZE, ID2LABEL, MULTI_LABEL, SCORE_FUNCTION, SPLADE_POOLING, SPLADE_ACTIVATION,
                   VOCAB_SIZE, SIMILARITY, VECTOR_SIZE, INPUT_TYPES, SERVES, SPARSE_FORM, TOP_K, IMPOSSIBLE_ANSWER)
POSTPROCESS = (TASK, HEAD, *TASK_PARAMETERS)
DESCRIBED = (PRECISION, BACKEND, MATRYOSHKA_DIMS, TOKEN_MODEL, EMBEDDING_MODEL)
ENSEMBLE = (TASK, *TASK_PARAMETERS, PROMPTS, DEFAULT_PROMPT_NAME, *DESCRIBED)
ENCODER = (HINT_BF16, PERFORMANCE_HINT, INFERENCE_NUM_THREADS, NUM_STREAMS, WARMUP_QUERY_TOKENS)
JOINED = (JOINED_STEPS, JOINED_SCHEDULE, JOINED_BACKENDS)
#: Every key a served model's config may hold.
KEYS = frozenset(parameter.key for group in (TOKENIZER, POSTPROCESS, ENSEMBLE, ENCODER, JOINED)
                 for parameter in group)


def write(values: Mapping[Parameter, Any]) -> dict[str, str]:
    """``values`` (parameter -> typed value) as a config's string map; a None value is left out."""
    return {parameter.key: parameter.text(value) for parameter, value in values.items() if value is not None}


def strings(config: Mapping[str, Any]) -> dict[str, str]:
    """A config's parameters as strings, from its JSON (what Triton hands a python model as
    ``args["model_config"]``, or a client's answer, bare or under gRPC's ``config``).  Triton writes
    ``string_value``; JSON made by protobuf's default (camelCase) names writes ``stringValue``: both are
    the same field."""
    config = config.get("config", config)
    return {key: value.get("string_value", value.get("stringValue", ""))
            for key, value in config.get("parameters", {}).items()}


def message_strings(parameters: Mapping[str, Any]) -> dict[str, str]:
    """A ``ModelConfig`` message's ``parameters`` (Triton's protobuf schema) as strings."""
    return {key: value.string_value for key, value in parameters.items()}


@dataclass(frozen=True)
class Prompts:
    """A model's named prompts, which its tokenizer step applies and its ensembles describe."""

    #: name -> the text put in front of each text
    named: dict[str, str] = field(default_factory=dict)
    #: the one applied where a request names none (None: no prompt)
    default: str | None = None

    def write(self) -> dict[str, str]:
        """The parameters; a model without prompts has none."""
        return write({PROMPTS: self.named or None, DEFAULT_PROMPT_NAME: self.default})

    @classmethod
    def read(cls, params: Mapping[str, str]) -> Prompts:
        return cls(PROMPTS.read(params, {}), DEFAULT_PROMPT_NAME.read(params, None))


@dataclass(frozen=True)
class TokenizerParameters:
    """The tokenizer step's parameters, as ``exporter/triton/config.py`` writes them and the step reads them."""

    #: :data:`MODE`
    mode: str
    #: :data:`MAX_LENGTH`
    max_length: int
    #: :data:`PAD_ID`
    pad_id: int
    truncate: bool = True
    #: :data:`PAD_WIDTHS` (empty: ``max_length`` alone)
    pad_widths: tuple[int, ...] = ()
    #: :data:`STRIDE` (0: windows do not overlap; not written)
    stride: int = 0
    #: :data:`MAX_ROWS` (None: no bound of its own)
    max_rows: int | None = None
    #: :data:`SIDES` (None: not a ``sided`` tokenizer)
    sides: str | None = None
    prompts: Prompts = field(default_factory=Prompts)

    @property
    def widths(self) -> tuple[int, ...]:
        """The widths a batch is padded to."""
        return self.pad_widths or (self.max_length,)

    def write(self) -> dict[str, str]:
        return {**write({MODE: self.mode, MAX_LENGTH: self.max_length, PAD_ID: self.pad_id,
                         TRUNCATE: self.truncate, PAD_WIDTHS: self.pad_widths or None, STRIDE: self.stride or None,
                         MAX_ROWS: self.max_rows, SIDES: self.sides}),
                **self.prompts.write()}

    @classmethod
    def read(cls, params: Mapping[str, str]) -> TokenizerParameters:
        """The parameters in ``params``; a ValueError naming a missing ``max_length`` or ``pad_id``."""
        return cls(MODE.read(params, "single"), MAX_LENGTH.read(params), PAD_ID.read(params),
                   TRUNCATE.read(params, True), PAD_WIDTHS.read(params, ()), STRIDE.read(params, 0),
                   MAX_ROWS.read(params, None), SIDES.read(params, None), Prompts.read(params))
