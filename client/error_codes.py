"""Stable codes at the start of the errors nexus-sli's server-side code returns.

The Triton python models (tokenizer, post-processing) and the encoder backend
shims prefix every error they return to a request with :func:`mark`; the
client maps the code (:func:`code_of`), never the wording, to its error type,
so messages can be reworded freely.  Triton's ensemble puts its own text in
front of a step's message, so the marker is looked for anywhere in it.

It also names what the tokenizer model reads and answers besides its token
tensors (the request parameters, its optional inputs and outputs, the token
counts): the client and the exporter's configs send and declare what the model
reads, from one place.

This file is copied beside those models in every repository, so it imports
nothing but the standard library.
"""

import re

#: The request parameter naming the prompt the tokenizer step puts in front of each text (the
#: model's ``prompts``, from its sentence-transformers config); absent: the model's default prompt.
PROMPT_PARAMETER = "prompt_name"
#: The request parameter naming the side of a late-interaction model's request (``query`` or
#: ``document``, ``python_models/sides.py``): its marker, length, expansion and scoring mask.
INPUT_TYPE_PARAMETER = "input_type"
#: Request parameters (booleans) of the tokenizer model's two text modes: whether ``TOKENS`` adds the
#: model's special tokens ([CLS], [SEP] ...), and whether ``DECODED`` leaves them out.
ADD_SPECIAL_TOKENS_PARAMETER = "add_special_tokens"
SKIP_SPECIAL_TOKENS_PARAMETER = "skip_special_tokens"
#: The tokenizer model's optional output asked for by name: per text, one JSON object of its tokens,
#: ``{"ids", "text", "special", "offsets", "bytes"}`` (offsets: [start, stop) characters of the prompted text;
#: bytes: the same spans in its UTF-8 bytes, absent from exports before them; text: the characters a token
#: covers, a special token's own string), untruncated.
TOKENS_OUTPUT = "TOKENS"
#: The tokenizer model's optional input of token ids ([rows, n] int64, each row padded with
#: :data:`NO_TOKEN`), sent instead of ``TEXT``, and the output that answers it: each row's text.
IDS_INPUT = "IDS"
DECODED_OUTPUT = "DECODED"
NO_TOKEN = -1
#: Each row's token count ([1] int64 per text): the tokens the encoder reads, special tokens and the
#: prompt included, after truncation.  The tokenizer step of a task that reports usage (``TaskSpec.usage``)
#: answers it beside its token tensors, and that task's ensemble maps it to an output of the same name,
#: so one call answers the vectors and OpenAI's ``usage``.
TOKEN_COUNT_OUTPUT = "TOKEN_COUNT"

#: The request cannot be served as sent: an empty, too long or undecodable text,
#: tensors that do not fit together.  Sending it again fails again.
INVALID_INPUT = "invalid_input"
#: A well-formed request the model failed on (ids outside the vocabulary, a failed head).
INFERENCE_FAILED = "inference_failed"

CODES = (INVALID_INPUT, INFERENCE_FAILED)
_MARKER = re.compile(r"\[nexus:([a-z_]+)\]")


def mark(code: str, message: str) -> str:
    """``message`` with ``code``'s marker in front."""
    if code not in CODES:
        raise ValueError(f"unknown error code {code!r}; known: {', '.join(CODES)}")
    return f"[nexus:{code}] {message}"


def code_of(message: str) -> "str | None":
    """The code marked in ``message``, or None for errors nexus-sli did not mark (Triton's own)."""
    found = _MARKER.search(message)
    return found.group(1) if found and found.group(1) in CODES else None
