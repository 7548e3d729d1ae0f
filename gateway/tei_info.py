"""TEI's ``GET /info``: the served model and this gateway's limits, in TEI's ``Info`` shape.

Every figure is what the gateway or the model's own configs say (the model's
:class:`~nexus_sli.client.model_info.ModelInfo`), none is assumed: a client
sizes its batches by them.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from nexus_sli.client.model_info import ModelInfo

from .config import GatewayConfig

#: The export's precision names as TEI names a model's dtype.
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int8": "int8"}
#: ``max_concurrent_requests`` of a gateway run without a bound (``--max-concurrent-requests 0``):
#: TEI's field has no "unbounded", so it says int32's largest value.
UNBOUNDED = 2**31 - 1


def package_version() -> str:
    try:
        return version("nexus-sli")
    except PackageNotFoundError:  # run from a source tree without an install
        return "unknown"


def model_type(model: ModelInfo) -> dict:
    """TEI's ModelType: an embedding model with its pooling (a multi-vector model pools nothing: one vector
    per scored token; a model with several heads, such as BGE-M3, by its dense vector's), a reranker, else a
    classifier, with its labels."""
    if model.task == "multi-vector":
        return {"embedding": {"pooling": "none"}}
    if model.task in ("embedding", "sparse-embedding") or model.serves("embedding"):
        pooling = "splade" if model.task == "sparse-embedding" else model.pooling or "mean"
        return {"embedding": {"pooling": pooling}}
    id2label = {str(index): label for index, label in sorted(model.id2label.items())}
    labels = {"id2label": id2label, "label2id": {label: int(index) for index, label in id2label.items()}}
    return {"reranker" if model.task == "rerank" else "classifier": labels}


#: Info's fields beyond TEI's: the size of the vectors an embedding or multi-vector model serves (the
#: Dense-projected size where its pipeline has Dense modules), which TEI's clients otherwise learn from a first
#: /embed; and the runtime serving the encoder (``nexus-sli serve`` may swap in a faster one while it serves).
EXTENSIONS = ("dimensions", "backend")


def info(model: ModelInfo, config: GatewayConfig) -> dict:
    """``model``'s Info: its longest input and batch from its tokenizer step's config, the request limits
    from ``config``, and (:data:`EXTENSIONS`) an embedding model's dimensions."""
    step = model.tokenizer_step
    max_length, rows = (step.max_length, step.rows) if step else (0, model.max_batch_size)
    described = model.task in ("embedding", "multi-vector") or model.serves("embedding")
    extensions = {**({"dimensions": model.dimensions} if described else {}), "backend": model.backend}
    return {**extensions,
        "model_id": model.name, "model_sha": None, "served_model_name": model.name,
        "model_dtype": DTYPES.get(model.precision or "", model.precision or "unknown"),
        "model_type": model_type(model),
        "max_concurrent_requests": config.max_concurrent_requests or UNBOUNDED,
        "max_input_length": max_length,
        "max_batch_tokens": max_length * max(rows, 1),
        "max_batch_requests": model.max_batch_size or None,
        "max_client_batch_size": config.max_inputs,
        "auto_truncate": step.truncate if step else True,
        "tokenization_workers": step.instances if step else 1,
        "version": package_version(), "sha": None, "docker_label": None,
    }
