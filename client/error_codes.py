"""Stable codes at the start of the errors nexus-sli's server-side code returns.

The Triton python models (tokenizer, post-processing) and the encoder backend
shims prefix every error they return to a request with :func:`mark`; the
client maps the code (:func:`code_of`), never the wording, to its error type,
so messages can be reworded freely.  Triton's ensemble puts its own text in
front of a step's message, so the marker is looked for anywhere in it.

It also names the one request parameter the tokenizer model reads
(:data:`PROMPT_PARAMETER`): the client sends what the model reads, from one place.

This file is copied beside those models in every repository, so it imports
nothing but the standard library.
"""

import re

#: The request parameter naming the prompt the tokenizer step puts in front of each text (the
#: model's ``prompts``, from its sentence-transformers config); absent: the model's default prompt.
PROMPT_PARAMETER = "prompt_name"

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
