"""The served tasks: one registered spec per task (:mod:`nexus_sli.tasks.spec`).

Adding a task: a module here that registers its :class:`TaskSpec`, imported
below, and its head in ``exporter/triton/python_models/heads.py``
(docs/extending.md).
"""

# Registration order is the order tasks are listed in; kept by hand, not sorted.
from . import embedding  # noqa: F401, I001
from . import classification  # noqa: F401
from . import rerank  # noqa: F401
from . import token_classification  # noqa: F401
from . import question_answering  # noqa: F401
from . import sparse_embedding  # noqa: F401
from . import multi_vector  # noqa: F401
from . import bge_m3  # noqa: F401
from .spec import TASKS, TaskError, TaskSpec, Tensor, get_task, infer_task, register

__all__ = ["TASKS", "TaskError", "TaskSpec", "Tensor", "get_task", "infer_task", "register"]
