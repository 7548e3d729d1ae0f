"""TEI's ``truncate`` and ``truncation_direction`` against what the export does.

The served tokenizer truncates a text past the model's length on the right, or refuses it, as its
export chose (``/info``'s ``auto_truncate``, which is also TEI's default for ``truncate``).  An option
asking otherwise is refused where it would change the answer, never silently ignored:

- ``truncation_direction`` other than right, always;
- ``truncate: false`` on an export that truncates, for a text past the model's length (TEI refuses
  it, the export would cut it).  The texts are counted by the tokenizer step's ``TOKENS`` mode, as
  the encoder would read them (prompt and special tokens included), where the model's tokenizer reads
  single texts and has that mode; elsewhere (a reranker's pairs, a late-interaction model's sides,
  an older export) ``truncate: false`` is refused outright.

``truncate: true`` on an export that does not truncate needs no check: a longer text is refused
by the export itself, so the answer is never a different result, only an error TEI would not give.
"""

from __future__ import annotations

from nexus_sli.client.model_info import ModelInfo
from nexus_sli.tasks.spec import TaskError, get_task

from .errors import GatewayError
from .limits import flag


def check_direction(options: dict) -> None:
    """``truncation_direction``: only right-side truncation exists; ``truncate`` must be a flag."""
    direction = options.get("truncation_direction")
    if direction is not None and str(direction).lower() != "right":
        raise GatewayError("invalid", f"truncation_direction {direction!r} is not available: the served "
                           "tokenizer truncates on the right", param="truncation_direction")
    flag(options, "truncate", True)


async def check_truncate(backend, options: dict, model: ModelInfo, texts: list[str], param: str,
                         prompt_name: str | None = None, names: list[str] | None = None) -> None:
    """Refuse ``truncate: false`` where the export would cut one of ``texts`` (TEI's 422 for such a text), named
    ``param[i]``, or as ``names`` names each text."""
    step = model.tokenizer_step
    truncates = step is None or step.truncate  # unknown: as /info reports it, truncating
    if flag(options, "truncate", True) or not truncates:
        return
    if step is None or not step.tokenizes or not _single_text(model):
        raise GatewayError("invalid", f"truncate=false is not available for model {model.name!r}: its export "
                           "truncates longer texts, and the gateway cannot count this model's tokens before "
                           "sending them; leave truncate out (the export's own choice, /info's auto_truncate)",
                           param="truncate")
    found = await backend.tokenize(model, texts, prompt_name, True)
    for index, tokens in enumerate(found):
        if len(tokens["ids"]) > step.max_length:
            named = names[index] if names else f"{param}[{index}]"
            raise GatewayError("invalid", f"{named} has {len(tokens['ids'])} tokens, more than model "
                               f"{model.name!r} takes ({step.max_length}), and truncate is false: shorten it, or "
                               "send truncate=true to have it cut", param=param, code="input_too_long")


def _single_text(model: ModelInfo) -> bool:
    """Whether the model's tokenizer reads one text per row, so that its ``TOKENS`` are the encoder's rows."""
    try:
        return get_task(model.task).tokenizer_mode == "single"
    except TaskError:
        return False
