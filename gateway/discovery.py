"""Which models Triton serves, and their tasks, read from the server itself.

The names come from Triton's repository index.  ``nexus-sli serve`` restricts
the repository API to its supervisor (exporter/serving/server.py), so where the
index is refused the names come from the statistics API instead, which lists
every loaded model and is not restricted.  Each model's config then says what
it is: a nexus-sli model is an ensemble with a ``task`` parameter (or one
``nexus-sli serve`` joined into one python model); its first
step is its tokenizer (asked for token counts where the ensemble answers none),
its outputs say whether it answers them, and its first output's last dimension
is the embedding size (or the number of labels).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from nexus_sli.client import ModelNotFoundError, ModelUnavailableError
from nexus_sli.client.model_info import ModelInfo
from nexus_sli.client.protocol import translate
from nexus_sli.tasks.spec import TOKEN_TASK

from .errors import GatewayError

#: A task a route takes, or several (one of them).
Tasks = str | tuple[str, ...]


def served_model(name: str, config: dict) -> ModelInfo | None:
    """The model a Triton config (JSON) describes, or None if it is not a nexus-sli task model."""
    model = ModelInfo.from_config(name, config)
    # the steps carry the task too (the post-processing picks its head by it): only the ensemble is the model,
    # served as exported or joined (``nexus-sli serve``)
    ensemble = config.get("platform") == "ensemble" or model.joined
    return model if ensemble and model.task else None


async def model_names(triton, timeout_s: float | None = None) -> list[str]:
    """Names of the ready models: the repository index, else (restricted) the statistics API.
    ``timeout_s``: each call's deadline; a Triton that hangs is a ServerUnavailableError."""
    try:
        index = await triton.get_model_repository_index(as_json=True, client_timeout=timeout_s)
        return [m["name"] for m in index.get("models", []) if m.get("state", "READY") == "READY"]
    except Exception as exc:  # noqa: BLE001 - refused (restricted) or unreachable: the statistics call tells which
        if _status(exc) == "StatusCode.DEADLINE_EXCEEDED":  # hung: asking again would only wait again
            raise translate(exc, "") from None
    try:
        stats = await triton.get_inference_statistics(model_name="", as_json=True, client_timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001
        raise translate(exc, "") from None
    return sorted({m["name"] for m in stats.get("model_stats", [])})


def _status(exc: Exception) -> str | None:
    status = getattr(exc, "status", None)
    return str(status()) if callable(status) else None


async def discover(triton, timeout_s: float | None = None) -> dict[str, ModelInfo]:
    """Every nexus-sli task model Triton serves now, by name, each with its tokenizer step's config
    (read in the same pass: the steps are served models too)."""
    configs = {}
    for name in await model_names(triton, timeout_s):
        try:
            config = await triton.get_model_config(name, as_json=True, client_timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001
            error = translate(exc, name)
            if isinstance(error, ModelNotFoundError):  # unloaded since it was listed
                continue
            raise error from None
        configs[name] = config.get("config", config)
    found = {}
    for name, config in configs.items():
        model = served_model(name, config)
        if model is not None:
            found[name] = model.with_tokenizer_step(configs[model.tokenizer]) if model.tokenizer in configs else model
    return found


#: How long a model that was served and is missing now counts as reloading (a 503) rather than
#: removed (a 404): a python-backend worker restarts in seconds, a large model loads in a minute or two.
RELOAD_GRACE_S = 300.0
#: A request naming an unknown model reads the list again, at most this often: requests
#: for a misspelt name must not turn into a stream of config reads.
MISS_REFRESH_S = 1.0


class Catalog:
    """The served models, read again after ``ttl_s`` or when a request names one not seen yet.  ``on_replicas``:
    how a read is made, ``await on_replicas(read)`` running ``read(connection)`` on Triton's replicas in turn,
    again after pauses while a retry budget lasts (the gateway's client's retries); by default once, on ``triton``."""

    def __init__(self, triton, ttl_s: float, timeout_s: float | None = None,
                 on_replicas: Callable[[Callable[[object], Awaitable]], Awaitable] | None = None):
        self._ttl_s, self._timeout_s = ttl_s, timeout_s
        self._on_replicas = on_replicas or (lambda read: read(triton))
        self._models: dict[str, ModelInfo] = {}
        #: model -> (the model, when a list last had it).  One missing from a later list is being reloaded
        #: (a worker that died, a new version): requests for it are a 503 to retry, not a 404 no client
        #: would retry, for :data:`RELOAD_GRACE_S`; a model gone longer was removed, and is a 404 again
        self._seen: dict[str, tuple[ModelInfo, float]] = {}
        self._read_at = float("-inf")
        self._lock = asyncio.Lock()
        #: the last read that failed, and when: the requests that waited for it are answered its error
        self._failure: Exception | None = None
        self._failed_at = float("-inf")

    def _stale(self, max_age_s: float) -> bool:
        return time.monotonic() - self._read_at > max_age_s

    async def models(self, max_age_s: float | None = None) -> dict[str, ModelInfo]:
        """The models, read again when older than ``max_age_s`` (default: the ttl)."""
        max_age_s = self._ttl_s if max_age_s is None else max_age_s
        # a fresh list is answered without the lock: requests never wait behind a discovery they do not need
        if not self._stale(max_age_s):
            return self._models
        waiting_since = time.monotonic()
        async with self._lock:  # one read for every request that finds the list stale at once
            # a read that failed while this request waited has spent its retries: reading again would make
            # each request behind it wait one more retry budget
            if self._failure is not None and self._failed_at >= waiting_since:
                raise self._failure.with_traceback(None)
            if self._stale(max_age_s):  # again: another request may have read it while this one waited
                try:
                    self._models = await self._on_replicas(lambda triton: discover(triton, self._timeout_s))
                except Exception as exc:
                    self._failure, self._failed_at = exc, time.monotonic()
                    raise
                self._seen.update({n: (m, time.monotonic()) for n, m in self._models.items()})
                self._read_at = time.monotonic()
        return self._models

    def check_not_reloading(self, name: str, models: dict[str, ModelInfo]) -> None:
        """Raise the retryable :class:`ModelUnavailableError` (a 503) where ``name`` was served here and
        is missing from ``models`` now."""
        if name not in models and self._recently_served(name):
            raise self._reloading(name)

    def _recently_served(self, name: str) -> bool:
        return name in self._seen and time.monotonic() - self._seen[name][1] < RELOAD_GRACE_S

    def _reloading(self, name: str) -> ModelUnavailableError:
        return ModelUnavailableError(f"model {name!r} was served here and is not ready now (being reloaded, or "
                                     "its worker restarted); retry shortly")

    async def _looked_up(self, name: str) -> dict[str, ModelInfo]:
        """The models, read again where ``name`` is not among them (perhaps loaded since the list was read); the
        503 of :meth:`check_not_reloading`."""
        models = await self.models()
        if name not in models:
            models = await self.models(max_age_s=MISS_REFRESH_S)
        self.check_not_reloading(name, models)
        return models

    async def get(self, name: str, task: Tasks | None) -> ModelInfo:
        """The model ``name``, checked to serve ``task`` (one of them, for a tuple; None: any): 404 if unknown,
        400 naming its task if another."""
        models = await self._looked_up(name)
        if name not in models:
            served = ", ".join(sorted(models)) or "none"
            raise GatewayError("not_found", f"model {name!r} is not served here; served models: {served}",
                               param="model", code="model_not_found")
        model = models[name]
        if task is not None and not serving(model, task):
            raise GatewayError("wrong_task", f"model {name!r} serves task {model.task!r}, not {named(task)}; "
                               f"{_route_hint(model)}", param="model", code="wrong_task")
        return model

    async def pinned(self, name: str, task: Tasks | None) -> ModelInfo:
        """The gateway's ``--tei-model`` ``name``, of any task: a 404 naming the flag where it is not served (a
        misspelt flag must not quietly route to another model), the 503 of :meth:`check_not_reloading`.
        ``task``: the route's, whose models the 404 lists (None: every model)."""
        models = await self._looked_up(name)
        if name not in models:
            fitting = sorted(n for n, m in models.items() if (serving(m, task) if task else m.task != TOKEN_TASK))
            which = f"models serving {named(task)}" if task else "served models"
            raise GatewayError("not_found", f"the gateway's --tei-model {name!r} is not served here; {which}: "
                               f"{', '.join(fitting) or 'none'}. Restart the gateway with one of them, or name one "
                               "with the request field \"model\"", param="model", code="model_not_found")
        return models[name]

    async def only_for(self, task: Tasks) -> ModelInfo:
        """TEI's routes name no model: the one model serving ``task`` (one of them, for a tuple), else a 400
        saying what to send."""
        models = await self.models()
        matching = sorted(n for n, m in models.items() if serving(m, task))
        if len(matching) == 1:
            return models[matching[0]]
        if matching:
            raise GatewayError("invalid", f"several models serve {named(task)} ({', '.join(matching)}): name one "
                               f"with the request field \"model\"", param="model")
        gone = sorted(n for n, (m, _) in self._seen.items()
                      if serving(m, task) and n not in models and self._recently_served(n))
        if len(gone) == 1:  # the route's one model, reloading
            raise self._reloading(gone[0])
        served = ", ".join(f"{n} ({m.task})" for n, m in sorted(models.items())) or "none"
        raise GatewayError("wrong_task", f"no model here serves task {named(task)}; served models: {served}",
                           param="model", code="wrong_task")


    async def only(self) -> ModelInfo:
        """The routes of every task (TEI's /info, /tokenize, /decode) name no model: the one served, else a 400.
        An embedding model's token ensemble (``NAME_tokens``) is part of it, not a second model."""
        models = {name: model for name, model in (await self.models()).items() if model.task != TOKEN_TASK}
        if len(models) == 1:
            return next(iter(models.values()))
        served = ", ".join(sorted(models)) or "none"
        raise GatewayError("invalid", f"this route needs one model and {len(models)} are served ({served}): name "
                           "one with the request field \"model\" (GET /info: ?model=NAME), or start the gateway "
                           "with --tei-model", param="model")


#: The gateway routes that serve each task.
ROUTES = {"embedding": "POST /v1/embeddings, /embed, /embed_all or /similarity",
          "sparse-embedding": "POST /embed_sparse", "rerank": "POST /rerank", "classification": "POST /predict",
          "multi-vector": "POST /embed_multi_vector or /rerank"}


def serving(model: ModelInfo, task: Tasks) -> bool:
    """Whether ``model`` serves ``task``, or one of them (a route several tasks answer, such as /rerank)."""
    return any(model.serves(t) for t in ((task,) if isinstance(task, str) else task))


def named(task: Tasks) -> str:
    return repr(task) if isinstance(task, str) else " or ".join(map(repr, task))


def _route_hint(model: ModelInfo) -> str:
    routes = [ROUTES[t] for t in model.tasks if t in ROUTES]
    return f"use {'; '.join(routes)}" if routes else "the gateway has no route for that task (use the Python client)"
