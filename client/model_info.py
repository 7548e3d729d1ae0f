"""What a served model is, read from its Triton config: the one description the client and the gateway share.

A nexus-sli model is an ensemble whose string ``parameters`` (their keys and types:
:mod:`nexus_sli.tasks.model_parameters`) say what it serves
(``task``, and ``serves`` where it answers other tasks' calls too), its named
prompts (``prompts``, ``default_prompt_name``), the sizes it was trained for
(``matryoshka_dims``), whether it normalises (``normalize``), its labels
(``id2label``), the precision of its encoder (``precision``) and, for a
late-interaction model, its score (``similarity``) and sides (``input_types``);
its outputs say whether it answers each text's token count beside its results;
its first step's own config, the tokenizer's, says how long an input may be and
whether that step answers the text modes (:class:`TokenizerStep`).  The
description parses them once, and holds the rules about them: which prompt
names and sides a request may send, which shorter sizes (Matryoshka) it may
ask for, and how a vector is cut to one.  Each caller turns
the typed errors into its own API's shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from nexus_sli.tasks import model_parameters as parameters
from nexus_sli.tasks import multi_vector

from .error_codes import DECODED_OUTPUT, IDS_INPUT, TOKEN_COUNT_OUTPUT, TOKENS_OUTPUT
from .errors import DimensionsError, UnknownInputTypeError, UnknownPromptError, WrongTaskError


#: The rows one request of an unbatched ensemble (a query and its documents) carries where its tokenizer step's
#: config was not read: exports before ``--max-batch-size`` took at least 64 (the encoder's default batch); one
#: that sets fewer says so in that step's config, which the clients read (:attr:`ModelInfo.bound_by_step`).
UNSTATED_ROWS = 64


@dataclass(frozen=True)
class TokenizerStep:
    """An ensemble's tokenizer model as its own config declares it."""

    #: the most tokens it makes of one input for the encoder
    max_length: int
    #: whether a longer input is truncated to ``max_length`` (else refused)
    truncate: bool
    #: how many instances of it tokenize at once
    instances: int
    #: the most encoder rows one execution of it makes (its batch, or the rows one query may become)
    rows: int = 0
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, config: dict) -> TokenizerStep:
        config = config.get("config", config)
        params = parameters.strings(config)
        instances = sum(int(group.get("count", 1)) for group in config.get("instance_group", []))
        rows = parameters.MAX_ROWS.read(params, int(config.get("max_batch_size", 0)))
        names = {side: tuple(tensor["name"] for tensor in config.get(side, [])) for side in ("input", "output")}
        return cls(parameters.MAX_LENGTH.read(params, 0), parameters.TRUNCATE.read(params, True), max(instances, 1),
                   rows, names["input"], names["output"])

    @property
    def tokenizes(self) -> bool:
        """Whether it answers each text's tokens (``TOKENS``); exports before that mode do not."""
        return TOKENS_OUTPUT in self.outputs

    @property
    def decodes(self) -> bool:
        """Whether it turns token ids (``IDS``) back into text (``DECODED``)."""
        return IDS_INPUT in self.inputs and DECODED_OUTPUT in self.outputs


@dataclass(frozen=True)
class ModelInfo:
    name: str
    task: str
    max_batch_size: int
    #: the config's string parameters, by name
    params: dict[str, str] = field(default_factory=dict)
    #: the last dimension of the model's output: an embedding's size, or the number of labels (0: variable)
    dimensions: int = 0
    #: the ensemble's first step, its tokenizer model (None: not an ensemble, nor one served joined)
    tokenizer: str | None = None
    #: that step as its own config declares it (None: not read)
    tokenizer_step: TokenizerStep | None = None
    #: the names of the model's outputs, as its config declares them
    outputs: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, name: str, config: dict) -> "ModelInfo":
        """The model ``name`` as its Triton config (JSON, or gRPC's ``{"config": ...}`` around it) describes it."""
        config = config.get("config", config)
        params = parameters.strings(config)
        outputs = config.get("output", [])
        dims = [int(d) for d in outputs[0].get("dims", [])] if outputs else []
        steps = [step["model_name"] for step in config.get("ensemble_scheduling", {}).get("step", [])]
        steps = steps or list(parameters.JOINED_STEPS.read(params, ()))
        return cls(name, parameters.TASK.read(params, ""), int(config.get("max_batch_size", 0)), params,
                   dimensions=max(dims[-1], 0) if dims else 0, tokenizer=steps[0] if steps else None,
                   outputs=tuple(output.get("name", "") for output in outputs))

    def with_tokenizer_step(self, config: dict) -> ModelInfo:
        """This description with its tokenizer step's, read from that model's Triton config."""
        return replace(self, tokenizer_step=TokenizerStep.from_config(config))

    @property
    def bound_by_step(self) -> bool:
        """Whether the most rows one request may carry is the tokenizer step's to say: an unbatched ensemble
        (a query and its documents, each document a row) states none of its own."""
        return self.max_batch_size == 0 and self.tokenizer is not None

    @property
    def rows_per_request(self) -> int:
        """The most items one request may carry: the tokenizer step's rows where its config was read, else the
        ensemble's ``max_batch_size``, else (an unbatched ensemble) :data:`UNSTATED_ROWS`."""
        rows = self.tokenizer_step.rows if self.tokenizer_step is not None else 0
        return rows or self.max_batch_size or UNSTATED_ROWS

    @property
    def tasks(self) -> tuple[str, ...]:
        """The tasks whose calls the model answers: its own, then those its ``serves`` parameter lists (a model
        with several heads, such as BGE-M3, serves embeddings, sparse weights and multi-vectors)."""
        others = [t for t in parameters.SERVES.read(self.params, ()) if t != self.task]
        return (self.task, *others)

    def serves(self, task: str) -> bool:
        return task in self.tasks

    def expect(self, task: str) -> None:
        if not self.serves(task):
            raise WrongTaskError(f"model {self.name!r} serves task {self.task or 'unknown'!r}, not {task!r}")

    @property
    def counts_tokens(self) -> bool:
        """Whether the model answers each text's token count (``TOKEN_COUNT``) with its results, in the same
        call; exports before it do not, and their tokenizer step is asked again instead."""
        return TOKEN_COUNT_OUTPUT in self.outputs

    @property
    def prompts(self) -> dict[str, str]:
        """The model's named prompts (an embedding model's sentence-transformers prompts; empty: none)."""
        return parameters.PROMPTS.read(self.params, {})

    @property
    def default_prompt_name(self) -> str | None:
        """The prompt the server applies when a request names none (None: no prompt)."""
        return parameters.DEFAULT_PROMPT_NAME.read(self.params, None)

    @property
    def trained_dimensions(self) -> list[int]:
        """The sizes the model was trained for (Matryoshka), largest first, where its card names them."""
        return parameters.MATRYOSHKA_DIMS.read(self.params, [])

    @property
    def normalizes(self) -> bool:
        """Whether the served model already normalises its vectors (the export's choice)."""
        return parameters.NORMALIZE.read(self.params, False)

    @property
    def precision(self) -> str | None:
        """The precision the encoder was exported in (None: an export that did not record it)."""
        return parameters.PRECISION.read(self.params, None)

    @property
    def backend(self) -> str | None:
        """The runtime serving the encoder (``onnxruntime``, ``openvino`` ...; None: an export that did not
        record it)."""
        return parameters.BACKEND.read(self.params, None)

    @property
    def pooling(self) -> str | None:
        """How an embedding model pools its token states (``mean``, ``cls``, ``max``; None: not said)."""
        return parameters.POOLING.read(self.params, None)

    @property
    def token_model(self) -> str | None:
        """The ensemble serving an embedding model's token states (None: it serves none)."""
        return parameters.TOKEN_MODEL.read(self.params, None) or None

    @property
    def joined(self) -> bool:
        """Whether ``nexus-sli serve`` serves this ensemble as one python model running its steps."""
        return parameters.JOINED_STEPS.key in self.params

    @property
    def id2label(self) -> dict[int, str]:
        return {int(k): v for k, v in parameters.ID2LABEL.read(self.params, {}).items()}

    @property
    def score_function(self) -> str | None:
        """How a classifier's or cross-encoder's served scores come from its logits (``softmax``, ``sigmoid``,
        ``none``: the logits themselves); None: an export before it said (a cross-encoder's: a sigmoid)."""
        return parameters.SCORE_FUNCTION.read(self.params, None)

    @property
    def similarity(self) -> str | None:
        """A multi-vector model's late-interaction score (``maxsim`` or ``meanmaxsim``; None: not one)."""
        return parameters.SIMILARITY.read(self.params, None)

    @property
    def input_types(self) -> tuple[str, ...]:
        """The sides a multi-vector model's requests may name (``input_type``)."""
        return parameters.INPUT_TYPES.read(self.params, tuple(multi_vector.INPUT_TYPES.split(",")))

    def check_input_type(self, input_type) -> str:
        """``input_type`` if it is one of :attr:`input_types`; else :class:`UnknownInputTypeError`, before
        anything is sent."""
        if not isinstance(input_type, str) or input_type not in self.input_types:
            raise UnknownInputTypeError(input_type, self.name, list(self.input_types))
        return input_type

    def check_prompt(self, prompt_name) -> str | None:
        """``prompt_name`` where it is None (the model's default prompt, if any) or one of :attr:`prompts`;
        else :class:`UnknownPromptError`, before anything is sent."""
        if prompt_name is None:
            return None
        if not isinstance(prompt_name, str) or prompt_name not in self.prompts:
            raise UnknownPromptError(prompt_name, self.name, list(self.prompts))
        return prompt_name

    def check_dimensions(self, dimensions, size: int | None = None) -> int | None:
        """``dimensions`` where it is None (the full size) or an integer from 1 to ``size`` (default: the
        model's :attr:`dimensions`); else :class:`DimensionsError`.  Any such size may be asked for: the
        trained ones only keep more of the full size's quality."""
        size = self.dimensions if size is None else size
        if dimensions is None:
            return None
        whole = isinstance(dimensions, (int, np.integer)) and not isinstance(dimensions, bool)
        if not whole or not 1 <= dimensions <= size:
            raise DimensionsError(dimensions, size, self.name, self.trained_dimensions)
        return dimensions

    def cut(self, vectors: np.ndarray, dimensions: int | None) -> np.ndarray:
        """Each vector's first ``dimensions`` values (None: the vectors as they are), checked against the
        vectors' own size.  Not normalised again: whether to is each API's rule."""
        if dimensions is None:
            return vectors
        return vectors[..., :self.check_dimensions(dimensions, vectors.shape[-1])]
