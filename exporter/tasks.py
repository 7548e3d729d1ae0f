"""What each served task needs from the model: its transformers class and outputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import NexusError


@dataclass(frozen=True)
class Task:
    name: str
    #: transformers auto class that builds the model for this task.
    auto_class: str
    #: Names of the encoder graph's outputs, in order, and the model output attribute of each.
    outputs: tuple[tuple[str, str], ...]

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
        Task("embedding", "AutoModel", (("last_hidden_state", "last_hidden_state"),)),
        Task("classification", "AutoModelForSequenceClassification", (("logits", "logits"),)),
        Task("rerank", "AutoModelForSequenceClassification", (("logits", "logits"),)),
        Task("token-classification", "AutoModelForTokenClassification", (("logits", "logits"),)),
        Task("question-answering", "AutoModelForQuestionAnswering",
             (("start_logits", "start_logits"), ("end_logits", "end_logits"))),
    )
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise NexusError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    return TASKS[name]
