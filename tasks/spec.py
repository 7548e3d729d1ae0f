"""What each served task needs from the model: its transformers class and outputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nexus_sli.exporter.errors import NexusError


@dataclass(frozen=True)
class Task:
    name: str
    #: transformers auto class that builds the model for this task.
    auto_class: str
    #: Names of the encoder graph's outputs, in order, and the model output attribute of each.
    outputs: tuple[tuple[str, str], ...]
    #: How int8 is judged against fp32: None (embeddings use cosine), "rows"
    #: (argmax per text), "tokens" (argmax per real token), "span" (argmax
    #: position of each output), "order" (pairwise order of scores).
    agreement: str | None = None
    #: Inputs are (first, second) text pairs: (query, document), (question, context).
    pair: bool = False
    #: The outputs have a sequence axis (one value per token), cut to the batch's real tokens.
    per_token: bool = False

    def build(self, config: Any):
        import transformers

        return getattr(transformers, self.auto_class).from_config(config, attn_implementation="eager")

    def output_names(self) -> list[str]:
        return [name for name, _ in self.outputs]

    def select_outputs(self, model_output: Any) -> tuple:
        return tuple(getattr(model_output, attribute) for _, attribute in self.outputs)


TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        Task("embedding", "AutoModel", (("last_hidden_state", "last_hidden_state"),), per_token=True),
        Task("classification", "AutoModelForSequenceClassification", (("logits", "logits"),), "rows"),
        Task("rerank", "AutoModelForSequenceClassification", (("logits", "logits"),), "order", pair=True),
        Task("token-classification", "AutoModelForTokenClassification", (("logits", "logits"),), "tokens",
             per_token=True),
        Task("question-answering", "AutoModelForQuestionAnswering",
             (("start_logits", "start_logits"), ("end_logits", "end_logits")), "span", pair=True, per_token=True),
    )
}


def infer_task(config: Any) -> Task:
    """The task a checkpoint was trained for, from its architectures: a
    sequence classifier with one label is a cross-encoder (rerank)."""
    architectures = list(getattr(config, "architectures", None) or [])
    for architecture in architectures:
        if architecture.endswith("ForSequenceClassification"):
            return TASKS["rerank" if getattr(config, "num_labels", 2) == 1 else "classification"]
        if architecture.endswith("ForTokenClassification"):
            return TASKS["token-classification"]
        if architecture.endswith("ForQuestionAnswering"):
            return TASKS["question-answering"]
    return TASKS["embedding"]


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise NexusError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    return TASKS[name]
